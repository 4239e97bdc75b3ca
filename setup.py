"""Build step: the import package `pdserve` (services/ -> pdserve, bench/ -> pdserve.bench) and its gRPC stubs,
generated from protos/ whenever setup.py runs, into services/v1 (`pdserve.v1`, the package the protos declare), so that
`pip install .` gives a package whose stubs are present. `python setup.py gen_stubs` runs only that step
(`make` and deploy/install.sh call it for the editable checkout)."""
import glob
import os

from setuptools import Command, setup

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = os.path.join(HERE, "protos")
STUBS = os.path.join(HERE, "services", "v1")


def generate_stubs() -> None:
    """protoc writes `from pdserve.v1 import x_pb2`, which resolves inside this package."""
    from grpc_tools import protoc

    files = sorted(glob.glob(os.path.join(PROTOS, "pdserve", "v1", "*.proto")))
    if not files:
        if os.path.isdir(STUBS):
            return  # built from an sdist that carries the stubs
        raise SystemExit(f"no protos under {PROTOS} and no generated stubs under {STUBS}")
    tmp = os.path.join(HERE, "build", "stubs")
    os.makedirs(tmp, exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTOS}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                      f"--pyi_out={tmp}", *files])
    if rc != 0:
        raise SystemExit(f"grpc_tools.protoc failed ({rc}) on {len(files)} protos under {PROTOS}")
    os.makedirs(STUBS, exist_ok=True)
    gen = os.path.join(tmp, "pdserve", "v1")
    for name in os.listdir(gen):
        os.replace(os.path.join(gen, name), os.path.join(STUBS, name))
    with open(os.path.join(STUBS, "__init__.py"), "w") as f:
        f.write('"""gRPC stubs generated from protos/pdserve/v1 at build time; never edited by hand."""\n')


def build_native() -> None:
    """The CPU decode attention kernel into services/engine/_native, shipped as package data; without a compiler
    here the engine builds it where it runs, or runs its torch path and says why (pdserve.engine.native)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("native_build", os.path.join(HERE, "services", "engine",
                                                                               "native_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        mod.build()
    except (OSError, RuntimeError) as e:
        print(f"setup.py: the CPU decode attention kernel was not built ({e})")


class GenStubs(Command):
    """Nothing beyond what importing setup.py did: generate the stubs."""
    description = "generate the gRPC stubs into services/v1 (pdserve.v1)"
    user_options: list = []

    def initialize_options(self):
        pass

    def finalize_options(self):
        pass

    def run(self):
        pass


def packages() -> list[str]:
    found = ["pdserve.v1"]
    for root, prefix in (("services", "pdserve"), ("bench", "pdserve.bench")):
        for d, dirs, files in os.walk(os.path.join(HERE, root)):
            dirs[:] = [x for x in dirs if x != "__pycache__" and not x.startswith(".")]  # not bench/.vllm-venv
            if "__init__.py" in files and os.path.relpath(d, HERE) != "services/v1":
                rel = os.path.relpath(d, os.path.join(HERE, root))
                found.append(prefix if rel == "." else f"{prefix}.{rel.replace(os.sep, '.')}")
    return sorted(set(found))


# every build step (egg_info lists pdserve.v1's files, build_py copies them, an editable install points at
# them) needs the stubs: they are generated first, from the protos as they are now (cheap, and never stale)
generate_stubs()
if os.environ.get("PDSERVE_SKIP_NATIVE") != "1":
    build_native()
setup(packages=packages(), package_data={"pdserve.v1": ["*.pyi"], "pdserve.bench": ["*.sh"],
                                         "pdserve.bench.tests": ["data/*.json.gz"],
                                         "pdserve.engine": ["csrc/*.c", "csrc/*.h", "_native/*.so"]},
      cmdclass={"gen_stubs": GenStubs})
