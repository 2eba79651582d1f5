"""Which code produced a result: a digest of the package's sources.

A results file names its commit, but a tree copied to a GPU machine may carry a stale .git,
so the commit can name the wrong code. The digest is computed from the sources the running
package imports and compiles (its Python modules, the CUDA sources and the user-kernel
templates), not from git, so it names the code that ran whatever .git says.
`tools/which_commit.py DIGEST` finds the commits whose tree has that digest.

The digest is 12 hex digits of a SHA-256 over the sorted (package path, SHA-256 of the bytes)
of every such file; package paths are the import view (`mlasandbox/cli/bench_cmd.py`), so the
installed package and a commit's tree (through REPO_FOLDERS) give the same digest.
"""
from __future__ import annotations

import hashlib
import subprocess
from functools import lru_cache
from importlib import resources

__all__ = ["REPO_FOLDERS", "digest", "sources_digest", "commit_sources"]

# import package -> the repository folder it is built from (setup.cfg's package_dir)
REPO_FOLDERS = {"mlasandbox": "sandbox", "mlasandbox.cli": "cli",
                "mlasandbox.cuda_src": "cuda_src", "mlasandbox.templates": "sandbox/templates"}
SUFFIXES = (".py", ".cu", ".cuh")
DIGEST_CHARS = 12


def _counted(name: str) -> bool:
    return name.endswith(SUFFIXES)


def digest(files) -> str:
    """The digest of `files`, (package path, bytes) pairs in any order."""
    h = hashlib.sha256()
    for name, sha in sorted((n, hashlib.sha256(b).hexdigest()) for n, b in files):
        h.update(f"{name}\0{sha}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS]


def _installed_files():
    for package in REPO_FOLDERS:
        root = resources.files(package)
        prefix = package.replace(".", "/")
        for node in root.iterdir():
            if node.is_file() and _counted(node.name):
                yield f"{prefix}/{node.name}", node.read_bytes()


@lru_cache(maxsize=1)
def sources_digest() -> str:
    """The digest of the package this process imported."""
    return digest(_installed_files())


def commit_sources(commit: str, repo: str = ".") -> list:
    """(package path, bytes) of every counted source in `commit`'s tree of the repository at
    `repo`. CalledProcessError where git cannot read it."""
    def git(*args, data=None):
        return subprocess.run(["git", "-C", repo, *args], input=data, capture_output=True,
                              check=True).stdout

    names = {}
    for package, folder in REPO_FOLDERS.items():
        listed = git("ls-tree", "--name-only", f"{commit}:{folder}").decode().split("\n")
        for leaf in filter(None, listed):
            if _counted(leaf):
                names[f"{folder}/{leaf}"] = f"{package.replace('.', '/')}/{leaf}"
    paths = sorted(names)
    out = git("cat-file", "--batch", data="".join(f"{commit}:{p}\n" for p in paths).encode())
    files, pos = [], 0
    for path in paths:  # each object: "<sha> blob <size>\n" + bytes + "\n"
        end = out.index(b"\n", pos)
        size = int(out[pos:end].split()[2])
        files.append((names[path], out[end + 1:end + 1 + size]))
        pos = end + 1 + size + 1
    return files
