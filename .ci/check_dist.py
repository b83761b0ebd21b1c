"""Check what a release ships: ``python .ci/check_dist.py DIST WHEELHOUSE``.

DIST holds what ``python -m build`` made (one sdist, one wheel), WHEELHOUSE the
wheel ``auditwheel repair`` made of it.  The sdist must carry every Cython
source and header of the package and no generated C or compiled file; the
wheels must carry every compiled module; the repaired wheel must be tagged
manylinux.  Exits non-zero naming the first thing missing.
"""
import glob
import os
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(pattern):
    found = glob.glob(pattern)
    if len(found) != 1:
        sys.exit(f"expected one file matching {pattern}, found {found}")
    return found[0]


def main(dist, wheelhouse):
    sources = sorted(os.path.basename(p) for ext in ("pyx", "pxd", "h")
                     for p in glob.glob(os.path.join(ROOT, "lorahook", f"*.{ext}")))
    compiled = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(ROOT, "lorahook", "*.pyx")))

    sdist = one(os.path.join(dist, "lorahook-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    inside = {n[len(top) + 1:] for n in names}
    missing = [s for s in sources if f"lorahook/{s}" not in inside]
    generated = sorted(n for n in inside if n.endswith((".c", ".so", ".pyc")))
    for need in ("setup.py", "pyproject.toml", "LICENSE", "CHANGELOG.md", "README.md"):
        if need not in inside:
            missing.append(need)
    if missing or generated:
        sys.exit(f"{sdist}: missing {missing}, generated files {generated}")
    print(f"{os.path.basename(sdist)}: {len(sources)} Cython sources and headers, no generated C")

    for wheel in (one(os.path.join(dist, "lorahook-*.whl")),
                  one(os.path.join(wheelhouse, "lorahook-*.whl"))):
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
        modules = sorted(n.split("/")[1].split(".")[0] for n in names
                         if n.startswith("lorahook/") and n.count("/") == 1 and n.endswith(".so"))
        if modules != compiled:
            sys.exit(f"{wheel}: compiled modules {modules}, expected {compiled}")
        if any(n.endswith(".c") for n in names):
            sys.exit(f"{wheel}: holds generated C")
        print(f"{os.path.basename(wheel)}: {len(modules)} compiled modules")
    if "manylinux" not in os.path.basename(wheel):
        sys.exit(f"{wheel}: not tagged manylinux")


if __name__ == "__main__":
    main(*sys.argv[1:])
