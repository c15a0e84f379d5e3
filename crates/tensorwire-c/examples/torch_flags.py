"""Prints the g++ flags that build a LibTorch program against the PyTorch this Python
imports (a virtual environment's too): the C++ standard, the C++ ABI PyTorch was built with,
include and library paths, libraries. Used by the Makefile and scripts/share-e2e.sh:

    g++ prog.cpp $(python3 torch_flags.py) -o prog
"""

import os
import shutil
import subprocess
import sys

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as e:
    sys.exit(f"torch_flags.py: PyTorch is not importable by {sys.executable}: {e}")


def standard() -> str:
    """C++20 where the compiler has it (recent PyTorch headers need it), else C++17."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
    probe = subprocess.run([cxx, "-std=c++20", "-x", "c++", "-E", "-"], input=b"", capture_output=True)
    return "-std=c++20" if probe.returncode == 0 else "-std=c++17"


abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
flags = [standard(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
flags += [f"-I{path}" for path in cpp_extension.include_paths()]
libs = cpp_extension.library_paths()
flags += [f"-L{path}" for path in libs] + [f"-Wl,-rpath,{path}" for path in libs]
cuda = ["-ltorch_cuda", "-lc10_cuda"] if torch.cuda.is_available() or torch.version.cuda else []
flags += ["-Wl,--no-as-needed", *cuda, "-ltorch", "-ltorch_cpu", "-lc10", "-Wl,--as-needed"]
print(" ".join(flags))
