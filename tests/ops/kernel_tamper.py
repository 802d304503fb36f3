"""Tamper cases for the kernel loader (hybridcache/accel/native/build.py), run as `python -m tests.ops.kernel_tamper
--workdir DIR --model PATH [--model PATH ...]` in a subprocess by test_kernel_tamper.py: a foreign constructor or a
SIGBUS must not be able to touch the test session.

For each case a fresh $HYBRIDCACHE_HOME gets the kernel directory of a genuine build, then the case tampers with it:
a planted library with the expected name whose constructor writes a marker file (with no manifest, with the genuine
manifest, with a forged manifest in a directory other users can write, as a group-writable file, as a symbolic link,
in a directory another user owns), a truncated library, a library without the expected symbols, a genuine build of a
source that lacks a symbol, each C source file changed in turn next to the pristine build. Then the loader runs and
the models generate greedily. One JSON line on stdout: per case the status line, the warnings, whether the C kernels
or the torch path ran, and whether the tokens equal the torch path's; and whether the marker file exists (it must
never).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

import hybridcache as hc
import hybridcache.accel.native.kernels as ck
import hybridcache.accel.native.library as cpu_library
from hybridcache.accel.native import build as _native
from hybridcache.ops._dispatch import DISABLE_ENV

FAST_FLAGS = ["-O0", "-march=native", "-shared", "-fPIC", "-std=gnu11"]  # the cases rebuild often: compile quickly

EVIL = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE *f = fopen(MARKER, "w");
  if (f) { fputs("foreign code ran\n", f); fclose(f); }
}
"""
NO_SYMBOLS = "int unrelated(void) { return 42; }\n"


def compile_c(source: str, out: Path, *defines: str) -> None:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", *defines, str(src), "-o", str(out)], check=True, capture_output=True)


def evil_source(marker: Path) -> str:
    """A constructor that writes the marker, and every symbol the loader expects (stubs): only the checks before
    dlopen can keep it out."""
    stubs = "".join(f"void {name}(void) {{}}\n" for name in ck.SIGNATURES)
    return EVIL.replace("MARKER", json.dumps(str(marker))) + stubs


def generate(models, prompts) -> list[list[int]]:
    with torch.no_grad():
        return [
            hc.generate(m, p, max_new_tokens=8, output_logits=False).sequences.tolist() for m, p in zip(models, prompts)
        ]


def manifest_for(path: Path, template: dict) -> dict:
    data = path.read_bytes()
    return {**template, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--model", action="append", required=True)
    args = parser.parse_args()
    work = Path(args.workdir)
    marker = work / "FOREIGN_CODE_RAN"
    _native.BASE_FLAGS[:] = FAST_FLAGS

    models = [hc.from_pretrained(path) for path in args.model]
    prompts = [torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(i)) for i in range(len(models))]

    def load(home: Path) -> dict:
        os.environ["HYBRIDCACHE_HOME"] = str(home)
        ck._reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            status = ck.kernel_status()
            tokens = generate(models, prompts)
            with torch.no_grad():  # the C path really runs (or really does not)
                ran = ck.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6) is not None
        return {
            "status": status,
            "path": "C" if status.startswith("C kernels") else "torch",
            "kernel_ran": ran,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, _native.KernelNotice)],
            "tokens": tokens,
        }

    os.environ[DISABLE_ENV] = "1"
    torch_path = load(work / "disabled")
    del os.environ[DISABLE_ENV]
    pristine = load(work / "pristine")
    assert pristine["path"] == "C", pristine["status"]
    kdir = work / "pristine" / "kernels"
    manifest_file = next(kdir.glob("cpu_decode-*.json"))
    template = json.loads(manifest_file.read_text())
    so_name = template["file"]

    evil = work / "evil.so"
    compile_c(evil_source(marker), evil)
    nosyms = work / "nosyms.so"
    compile_c(NO_SYMBOLS, nosyms)

    def home_with_build(name: str) -> Path:
        home = work / name
        shutil.copytree(work / "pristine" / "kernels", home / "kernels", ignore=shutil.ignore_patterns(".build-*"))
        os.chmod(home / "kernels", 0o700)
        return home

    def forge(home: Path, library: Path) -> None:
        (home / "kernels" / manifest_file.name).write_text(json.dumps(manifest_for(library, template)))

    cases = {}

    def case(name):
        def register(fn):
            home = home_with_build(name)
            fn(home, home / "kernels")
            cases[name] = load(home)
            return fn

        return register

    @case("planted, no manifest")
    def _(home, k):
        shutil.copy(evil, k / so_name)
        (k / manifest_file.name).unlink()

    @case("planted, genuine manifest (swapped library)")
    def _(home, k):
        shutil.copy(evil, k / so_name)

    @case("truncated, genuine manifest")
    def _(home, k):
        data = (k / so_name).read_bytes()
        (k / so_name).write_bytes(data[: len(data) // 3])

    @case("truncated, no manifest")
    def _(home, k):
        data = (k / so_name).read_bytes()
        (k / so_name).write_bytes(data[:4096])
        (k / manifest_file.name).unlink()

    @case("library without the expected symbols, no manifest")
    def _(home, k):
        shutil.copy(nosyms, k / so_name)
        (k / manifest_file.name).unlink()

    @case("planted + forged manifest, directory writable by others")
    def _(home, k):
        shutil.copy(evil, k / so_name)
        forge(home, evil)
        os.chmod(k, 0o777)

    @case("planted + forged manifest, library writable by group")
    def _(home, k):
        shutil.copy(evil, k / so_name)
        forge(home, evil)
        os.chmod(k / so_name, 0o775)

    @case("planted + forged manifest, library is a symbolic link")
    def _(home, k):
        (k / so_name).unlink()
        os.symlink(evil, k / so_name)
        forge(home, evil)

    if os.geteuid() == 0:  # only root can give a directory to another user

        @case("planted + forged manifest, directory owned by another user")
        def _(home, k):
            shutil.copy(evil, k / so_name)
            forge(home, evil)
            os.chown(k, 65534, 65534)

    def sources_with(name: str, file: str, first_line: str) -> Path:
        """A copy of the C sources whose `file` starts with `first_line`; returns the copy's entry file."""
        copy = work / name
        shutil.copytree(ck.SOURCE.parent, copy)
        (copy / file).write_text(first_line + "\n" + (copy / file).read_text())
        return copy / ck.SOURCE.name

    def load_from(home: Path, entry: Path) -> dict:
        cpu_library.SOURCE = entry  # what the loader builds
        try:
            return load(home)
        finally:
            cpu_library.SOURCE = ck.SOURCE

    # a genuine build (our compiler, our manifest) of a source that lacks a symbol: loads, then falls back
    stripped = sources_with("stripped", ck.SOURCE.name, "#define hc_selective_scan hc_selective_scan_renamed")
    cases["genuine build lacking a symbol"] = load_from(work / "stripped_home", stripped)

    # each source file changed in turn (every .c and header): the build key covers it, so the pristine library
    # beside it is not taken for the changed sources; the changed file is compiled (here it refuses to: #error)
    for file in sorted(name for name, _ in _native.read_sources(ck.SOURCE)):
        entry = sources_with(f"tampered-{file}", file, f"#error tampered {file}")
        cases[f"tampered source {file}"] = load_from(home_with_build(f"tampered-{file}-home"), entry)

    for result in cases.values():
        result["tokens_equal_torch_path"] = result.pop("tokens") == torch_path["tokens"]
    print(
        json.dumps(
            {
                "torch_path": torch_path["status"],
                "pristine": pristine["status"],
                "pristine_equal_torch_path": pristine["tokens"] == torch_path["tokens"],
                "cases": cases,
                "marker_exists": marker.exists(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
