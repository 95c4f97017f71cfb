# See typings/triton/__init__.pyi: triton.language as Any, for machines without triton.
from typing import Any

def __getattr__(name: str) -> Any: ...
