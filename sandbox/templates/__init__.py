"""Package data of the bring-your-own-kernel contract (sandbox/user_kernel.py): the header a
user kernel includes (mla_user.cuh) and the entry wrappers `mlasandbox new` appends to a copy
of a built-in kernel (*.entry.cu)."""
