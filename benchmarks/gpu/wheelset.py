"""The wheels an offline GPU host lacks for vLLM + phasescope, found against that host's `pip freeze`.

Run on a machine that reaches the package registry:

    python wheelset.py download --freeze host-freeze.txt --requirements requirements-vllm-0.24.0.txt --dest wheels/

- every pinned line of the requirements file whose project the host does not have is downloaded
  (`pip download --no-deps --only-binary=:all:` for the host's Python and manylinux platform);
  a project the host has is skipped and, when its version does not satisfy the pin, reported;
- then every downloaded wheel's own requirements (its METADATA, markers evaluated for the host)
  are checked: one that neither the host nor the wheel set satisfies is printed, unless the
  requirements file names it on a `# skip: NAME reason` line (e.g. vLLM's structured-output and
  kernel packages, which plain generation never imports) or, for a version conflict, on an
  `# override: NAME reason` line (the pinned version is kept; printed as a note).

    python wheelset.py check --freeze host-freeze.txt --requirements ... --dest wheels/

does only the second part. Exit status 1 when anything is missing. Stdlib + `packaging` only.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")


def read_freeze(path: pathlib.Path) -> dict[str, str]:
    """`pip freeze` output -> {canonical name: version} (editable / URL lines keep their name, version '')."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "==" in line:
            name, ver = line.split("==", 1)
            out[canonicalize_name(name)] = ver.split(";")[0].strip()
        elif " @ " in line:
            out[canonicalize_name(line.split(" @ ", 1)[0])] = ""
    return out


def read_requirements(path: pathlib.Path) -> tuple[list[Requirement], dict[str, str], dict[str, str]]:
    """Pinned requirements, `# skip: NAME reason` and `# override: NAME reason` lines."""
    reqs, skips, overrides = [], {}, {}
    for line in path.read_text().splitlines():
        m = re.match(r"#\s*(skip|override):\s*(\S+)\s*(.*)", line.strip())
        if m:
            (skips if m.group(1) == "skip" else overrides)[canonicalize_name(m.group(2))] = m.group(3)
            continue
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append(Requirement(line))
    return reqs, skips, overrides


def _env(python: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python, python_full_version=python + ".0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", implementation_name="cpython",
               platform_python_implementation="CPython", os_name="posix")
    return env


def _host_version(freeze: dict[str, str], name: str) -> Version | None:
    v = freeze.get(name)
    if v is None:
        return None
    try:
        return Version(v.split("+")[0]) if v else Version("9999")  # version unknown: taken as recent
    except Exception:  # noqa: BLE001 - an odd version string: treat as present
        return Version("0")


def plan(freeze: dict[str, str], reqs: list[Requirement]) -> tuple[list[Requirement], list[str]]:
    """(requirements to download, notes on projects the host has at a version outside the pin)."""
    fetch, notes = [], []
    for r in reqs:
        name = canonicalize_name(r.name)
        have = _host_version(freeze, name)
        if have is None:
            fetch.append(r)
        elif r.specifier and not r.specifier.contains(have, prereleases=True):
            notes.append(f"host has {name} {freeze[name]}, outside {r}: keeping the host's")
    return fetch, notes


def download(fetch: list[Requirement], dest: pathlib.Path, python: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    for r in fetch:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", *plat, "-d", str(dest), str(r)]
        subprocess.run(cmd, check=True)


def check(freeze: dict[str, str], dest: pathlib.Path, skips: dict[str, str], python: str,
          overrides: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(requirements of the wheels in `dest` that neither the host nor the wheel set satisfies, notes)."""
    wheels: dict[str, tuple[Version, pathlib.Path]] = {}
    for w in sorted(dest.glob("*.whl")):
        name, ver, _, _ = parse_wheel_filename(w.name)
        if name in wheels:
            raise SystemExit(f"two versions of {name} in {dest}: keep one")
        wheels[name] = (ver, w)
    env = _env(python)
    missing, notes = [], []
    for name, (ver, w) in wheels.items():
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode("utf-8", "replace").splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is not None and not r.marker.evaluate(dict(env, extra="")):
                continue
            dep = canonicalize_name(r.name)
            if dep in skips:
                continue
            have = wheels[dep][0] if dep in wheels else _host_version(freeze, dep)
            if have is None:
                missing.append(f"{name} {ver} needs {r}: not on the host, not in the wheel set")
            elif r.specifier and not r.specifier.contains(have, prereleases=True):
                if dep in (overrides or {}):
                    notes.append(f"{name} {ver} needs {r}: have {have} ({overrides[dep]})")
                else:
                    missing.append(f"{name} {ver} needs {r}: have {have}")
    return missing, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("download", "check", "plan"))
    ap.add_argument("--freeze", type=pathlib.Path, required=True, help="the host's `pip freeze` output")
    ap.add_argument("--requirements", type=pathlib.Path, required=True)
    ap.add_argument("--dest", type=pathlib.Path, default=pathlib.Path("wheels"))
    ap.add_argument("--python", default="3.12", help="the host's Python (major.minor)")
    a = ap.parse_args(argv)
    freeze = read_freeze(a.freeze)
    reqs, skips, overrides = read_requirements(a.requirements)
    fetch, notes = plan(freeze, reqs)
    for n in notes:
        print("note:", n)
    if a.mode == "plan":
        print("\n".join(str(r) for r in fetch))
        return 0
    if a.mode == "download":
        download(fetch, a.dest, a.python)
    missing, more = check(freeze, a.dest, skips, a.python, overrides)
    for n in more:
        print("note:", n)
    for m in missing:
        print("missing:", m)
    print(f"{len(list(a.dest.glob('*.whl')))} wheels in {a.dest}; {len(missing)} unmet requirements")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
