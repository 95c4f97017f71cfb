# triton is installed only on GPU machines. Without this stub, pyright resolves `import triton` in
# runtime/kernels/triton/ to that package itself and reports triton.jit and friends as missing.
# Every name is Any: the kernels are checked by running them, not by the type checker.
from typing import Any

def __getattr__(name: str) -> Any: ...
