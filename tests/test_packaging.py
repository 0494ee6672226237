"""Packaging as Python users expect: declarative metadata in setup.cfg, optional backends as
extras with a one-line error naming the install, every imported module declared, a license
file that matches, and the typing marker."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import os
import re
import shutil
import sys

import pytest

from .conftest import REPO, run_process


def _setup_cfg() -> dict:
    """setup.cfg's metadata in the shape of PEP 621's names."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))

    def lines(value: str) -> list[str]:
        kept = (line.split("#")[0].strip() for line in value.splitlines())
        return [line for line in kept if line]

    return {
        "license": cfg["metadata"]["license"],
        "dependencies": lines(cfg["options"]["install_requires"]),
        "optional-dependencies": {k: lines(v) for k, v in cfg["options.extras_require"].items()},
    }


PROJECT = _setup_cfg()


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def imported_top_modules() -> set[str]:
    """Top-level modules that wdsvlm's own code imports, standard library left out."""
    found = set()
    for folder, _, names in os.walk(os.path.join(REPO, "wdsvlm")):
        for name in (n for n in names if n.endswith(".py")):
            tree = ast.parse(open(os.path.join(folder, name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "wdsvlm"}


def test_every_third_party_module_the_code_imports_is_declared():
    distributions = importlib.metadata.packages_distributions()
    declared = {requirement_name(r) for r in PROJECT["dependencies"]}
    for extra in PROJECT["optional-dependencies"].values():
        declared |= {requirement_name(r) for r in extra}
    for module in imported_top_modules():
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        assert names & declared, f"wdsvlm imports {module} ({names}) but does not declare it"


def test_bucket_backends_and_plots_are_extras_not_core():
    core = {requirement_name(r) for r in PROJECT["dependencies"]}
    assert not core & {"s3fs", "gcsfs", "matplotlib"}
    extras = PROJECT["optional-dependencies"]
    assert {"s3", "gcs", "plots", "all"} <= set(extras)
    assert {requirement_name(r) for r in extras["s3"]} == {"s3fs"}
    assert {requirement_name(r) for r in extras["gcs"]} == {"gcsfs"}
    assert {requirement_name(r) for r in extras["plots"]} == {"matplotlib"}
    assert not core & {"ray", "pyarrow"}  # Parquet input and the Ray engine are extras
    assert {requirement_name(r) for r in extras["ray"]} == {"ray", "pyarrow"}
    assert {requirement_name(r) for r in extras["parquet"]} == {"pyarrow"}


def test_the_license_file_matches_the_declared_license_and_the_package_is_typed():
    assert PROJECT["license"] == "Apache-2.0"
    text = open(os.path.join(REPO, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert os.path.exists(os.path.join(REPO, "wdsvlm", "py.typed"))
    assert importlib.metadata.metadata("wdsvlm")["License"] == "Apache-2.0"
    assert "[project]" not in open(os.path.join(REPO, "pyproject.toml")).read()  # setup.cfg's


BLOCK = "import sys; sys.modules.update({m: None for m in ('s3fs', 'gcsfs', 'matplotlib')}); "


@pytest.mark.processes
@pytest.mark.parametrize(
    "url,extra", [("s3://bucket/ds", "s3"), ("gs://bucket/ds", "gcs")], ids=["s3", "gcs"]
)
def test_a_missing_backend_is_one_line_naming_the_install(url, extra):
    code = BLOCK + f"from wdsvlm.tools.cli import main; sys.exit(main(['verify', {url!r}, '-q']))"
    run = run_process([sys.executable, "-c", code], timeout=60)
    assert run.returncode == 1
    assert run.stderr.strip() == (
        f"wdsvlm verify: error: cannot open '{url}/index.json': its backend is not installed: "
        f"pip install 'wdsvlm[{extra}]'"
    )


@pytest.mark.processes
def test_parquet_input_and_the_ray_engine_without_their_extras_are_one_line_naming_them(tmp_path):
    block = "import sys; sys.modules.update({m: None for m in ('ray', 'pyarrow')}); "
    records = tmp_path / "r.jsonl"
    records.write_text(
        '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}\n'
    )
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    for args, extra in (
        (["--input", str(records), "--engine", "ray"], "ray"),
        (["--input", str(tmp_path / "t.parquet")], "parquet"),
    ):
        out = str(tmp_path / f"out-{extra}")
        code = block + f"from wdsvlm.tools.cli import main; sys.exit(main(['write', *{args!r}, "
        code += f"'--output', {out!r}, '-q']))"
        run = run_process([sys.executable, "-c", code], timeout=60)
        assert run.returncode == 1, run.stderr
        assert run.stderr.strip().endswith(f"pip install 'wdsvlm[{extra}]'"), run.stderr


@pytest.mark.processes
def test_the_energon_bench_without_its_extra_is_one_line_naming_it(tmp_path):
    script = os.path.join(REPO, "scripts", "bench_energon.py")
    code = (
        "import runpy, sys; sys.modules['megatron'] = None; "
        f"sys.argv = [{script!r}, '--workdir', {str(tmp_path)!r}]; "
        f"runpy.run_path({script!r}, run_name='__main__')"
    )
    run = run_process([sys.executable, "-c", code], timeout=60)
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip()
    assert "\n" not in line and line.endswith("pip install 'wdsvlm[bench]'"), run.stderr
    assert "needs megatron.energon" in line, line
    assert not os.listdir(tmp_path)  # it stopped before making any data


@pytest.mark.processes
def test_the_core_runs_without_the_extras(tmp_path):
    example = os.path.join(REPO, "shards_example")
    args = [example, "--tokenizer", os.path.join(example, "tokenizer"), "--max-length", "1024"]
    args += ["--limit", "20", "-q"]
    code = BLOCK + (
        "from wdsvlm.tools.cli import main; "
        f"print('codes', main(['stats', *{args!r}]), main(['stats', *{args!r}, '--out', "
        f"{str(tmp_path)!r}]))"
    )
    run = run_process(
        [sys.executable, "-c", code], timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert run.stdout.strip().splitlines()[-1] == "codes 0 1", run.stderr[-2000:]
    assert "samples" in run.stdout  # the table, without pictures
    # pictures asked for: one line says what to install
    assert run.stderr.strip().endswith("pip install 'wdsvlm[plots]'")


# What a build leaves in a source tree, and what no wheel is built from.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", ".hypothesis"
)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_wheel_installed_away_from_the_source_runs_the_tiny_processor_bench(tmp_path):
    # Built from a copy (a build writes build/ and *.egg-info into its source tree), offline
    # (no build isolation: the environment's setuptools), installed into a folder of its own.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    run = run_process([*build, "-w", str(tmp_path / "wheels"), str(source)], timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("wdsvlm-*.whl")
    site = tmp_path / "site"
    install = [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)]
    run = run_process(install, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]

    # The dataset without its tokenizer, and a working folder with nothing of the repository.
    data = tmp_path / "data"
    shutil.copytree(
        os.path.join(REPO, "shards_example"), data, ignore=shutil.ignore_patterns("tokenizer")
    )
    work = tmp_path / "work"
    work.mkdir()
    args = ["bench", str(data), "--processor", "tiny:qwen2_vl", "--limit", "6"]
    args += ["--workers", "0", "--batch-size", "2", "--max-length", "4096", "-q"]
    code = (
        "import sys, wdsvlm.tools.cli as cli; print('imported', cli.__file__); "
        "sys.exit(cli.main(sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}
    run = run_process([sys.executable, "-c", code, *args], timeout=300, cwd=work, env=env)
    assert run.stdout.startswith(f"imported {site / 'wdsvlm' / 'tools' / 'cli.py'}\n"), run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TinyQwen2VLProcessor" in run.stdout and "samples/s" in run.stdout, run.stdout


PUBLIC = {
    # the writer and the dataset's index
    "write_dataset",
    "WriteOptions",
    "WriteSummary",
    "index_tars",
    "load_index",
    "verify_dataset",
    # the loader and what a training step calls on its batches
    "Loader",
    "LoaderSettings",
    "RayWorkers",
    "Telemetry",
    "Source",
    "ReadPolicy",
    "model_inputs",
    "block_causal_mask",
    # the errors a user catches
    "WdsvlmError",
    "BadInputError",
    "DatasetExistsError",
    "ShardFormatError",
    "StorageError",
    "TooManyFailuresError",
}
STAGES = {
    "Plan",
    "WorkerConfig",
    "ReadSamples",
    "Shuffle",
    "ImageConfig",
    "DecodeImages",
    "Tokenize",
    "SkipStats",
    "Pack",
    "Packer",
    "Collate",
}


def test_the_package_exports_what_a_training_script_uses_and_the_stages_apart():
    import wdsvlm
    import wdsvlm.families
    import wdsvlm.pipeline

    for package, names in (
        (wdsvlm, PUBLIC),
        (wdsvlm.pipeline, STAGES),
        (wdsvlm.families, {"family_of"}),
    ):
        assert len(package.__all__) == len(names) and set(package.__all__) == names
        assert names <= set(dir(package)), names - set(dir(package))
        for name in names:
            value = getattr(package, name)
            assert getattr(value, "__name__", name) == name, (package.__name__, name)
    assert not STAGES & set(dir(wdsvlm)), "the stages are wdsvlm.pipeline's"
    with pytest.raises(AttributeError, match="module 'wdsvlm' has no attribute 'Plan'"):
        wdsvlm.Plan  # noqa: B018


@pytest.mark.processes
def test_importing_wdsvlm_and_its_writer_side_names_imports_no_torch():
    code = (
        "import sys, wdsvlm; names = dir(wdsvlm); "
        "[getattr(wdsvlm, n) for n in ('write_dataset', 'WriteOptions', 'WriteSummary', "
        "'load_index', 'verify_dataset', 'ReadPolicy', 'StorageError')]; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert {'Loader', 'index_tars'} <= set(names), names"
    )
    run = run_process([sys.executable, "-c", code], timeout=60)
    assert run.returncode == 0, run.stderr


def test_the_floors_of_torch_transformers_and_webdataset_are_the_versions_tested():
    """setup.cfg promises no version the tests never ran with: the floors of the libraries
    whose internals wdsvlm uses are the Makefile's torch and constraints.txt's pins."""
    from packaging.version import Version

    floors = {
        requirement_name(r): r.split(">=", 1)[1].split(",")[0]
        for r in PROJECT["dependencies"]
        if ">=" in r
    }
    pins = dict(
        line.strip().split("==", 1)
        for line in open(os.path.join(REPO, "constraints.txt"))
        if "==" in line and not line.startswith("#")
    )
    makefile = open(os.path.join(REPO, "Makefile")).read()
    pins["torch"] = re.search(r"^TORCH \?= torch===(\S+)", makefile, re.M)[1]
    for name in ("torch", "transformers", "webdataset"):
        assert Version(floors[name]) == Version(pins[name]), (name, floors[name], pins[name])
    readme = open(os.path.join(REPO, "README.md")).read()
    assert f"asks for `torch>={floors['torch']}`" in readme  # what a user choosing a build reads

    from wdsvlm import compat

    for name, supported in (
        ("torch", compat.TORCH_RANGE),
        ("transformers", compat.TRANSFORMERS_RANGE),
    ):
        assert supported.startswith(f">={floors[name]},"), (name, supported)
