"""Stand-ins for Ray and vLLM where they are not installed (a GPU machine with only the carried wheels).

The trainer check (`gpu_trainer.py`) runs upstream's actor-side PPO trainer in one process, with no Ray
actor and no engine, but the modules it imports name Ray and vLLM at import time: decorators
(`@ray.remote`), base classes (`PolicyModelActor.__ray_actor_class__`) and `from vllm... import` lines.
`install()` registers, for each package that is not importable, a module that satisfies those names;
anything of it that is *used* raises `NotInstalled`, naming the package. Where the package is installed
(this project's venv), nothing is touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

PACKAGES = ("ray", "vllm")


class NotInstalled(RuntimeError):
    pass


class _Absent:
    """A name taken from a stand-in: it may be imported, subclassed or decorated with; calling it (other
    than as `ray.remote`) raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotInstalled(f"{self._qualname} was called, and {self._qualname.split('.')[0]} is not installed "
                           "here (benchmarks/gpu_check/gpu_standins.py stands in for its names only)")

    def __mro_entries__(self, bases):  # `class X(absent.Name)`: an empty base of its own
        return (type(self._qualname.rsplit(".", 1)[-1], (), {}),)


class _RemoteClass:
    """What `ray.remote(cls)` returns here: the class under Ray's attribute for it, nothing remote."""

    def __init__(self, cls):
        self.__ray_actor_class__ = cls

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Absent(f"ray.remote({self.__ray_actor_class__.__name__}).{name}")


def _remote(*args, **kwargs):
    if len(args) == 1 and not kwargs and callable(args[0]):
        return _RemoteClass(args[0]) if isinstance(args[0], type) else args[0]
    return lambda target: _remote(target)


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `package` and every submodule of it a stand-in module."""

    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+standin"
        module.growmtp_standin = True
        if spec.name == "ray":
            module.remote = _remote
            module.is_initialized = lambda: False
        return module

    def exec_module(self, module):
        pass


def install(force: bool = False) -> list[str]:
    """Stand in for each of PACKAGES that cannot be imported (`force`: for each not yet imported, installed
    or not, as the GPU machine's environment is rehearsed on CPU); returns the names stood in for."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return [name for f in sys.meta_path if isinstance(f, _Finder) for name in f.packages]
    missing = [name for name in PACKAGES if name not in sys.modules
               and (force or importlib.util.find_spec(name) is None)]
    if missing:
        sys.meta_path.insert(0, _Finder(tuple(missing)))
    return missing
