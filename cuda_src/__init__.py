"""CUDA sources of mlasandbox, shipped as package data (one .cu per kernel family)."""
