"""Proves a build-time CA is in no part of an image: every file of every layer, the image
config and its history (`docker save`, which holds all of them), searched for each
certificate of the CA bundle that is not a public CA (Debian's ca-certificates).

A certificate is looked for as its DER bytes and as lines of its PEM body (a PEM line is
64 characters of the certificate's own base64, so it is found in a copied file, a merged
bundle, or a build argument recorded in the history, JSON-escaped or not).

    no_ca_in_images.py --ca corp-ca.pem IMAGE...

Exits 0 when no image holds any of them, 1 naming where one was found, 2 when the bundle has
no certificate to look for (only public CAs). Standard library only (make deploy-test).
"""

from __future__ import annotations

import argparse
import base64
import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.*?)\s*-----END CERTIFICATE-----", re.S)
PUBLIC = Path("/usr/share/ca-certificates")


def certificates(data: bytes) -> list[bytes]:
    """The DER bytes of every PEM certificate in `data`."""
    return [base64.b64decode(b"".join(body.split())) for body in PEM.findall(data)]


def needles(bundle: Path, public: Path) -> list[tuple[str, list[bytes]]]:
    """(label, byte strings that betray it) for each non-public certificate of the bundle."""
    known = {der for path in public.rglob("*.crt") for der in certificates(path.read_bytes())}
    out: list[tuple[str, list[bytes]]] = []
    for i, der in enumerate(certificates(bundle.read_bytes())):
        if der in known:
            continue
        b64 = base64.b64encode(der)
        lines = [b64[k : k + 64] for k in range(0, len(b64), 64)]
        # Not the first line: its first characters are the same for many certificates.
        body = [line for line in lines[1:-1] if len(line) == 64][:3]
        out.append((f"certificate #{i + 1} of {bundle}", [der, *body]))
    return out


def scan(data: bytes, where: str, looking: list[tuple[str, list[bytes]]], found: list[str]) -> int:
    """Searches a blob; a tar (a layer) is searched file by file. Returns the files searched."""
    if data[257:262] == b"ustar":
        count = 0
        with tarfile.open(fileobj=io.BytesIO(data)) as layer:
            for member in layer:
                f = layer.extractfile(member) if member.isfile() else None
                if f is not None:
                    count += scan(f.read(), f"{where}:{member.name}", looking, found)
        return count
    for label, patterns in looking:
        if any(p in data for p in patterns):
            found.append(f"{label} in {where}")
    return 1


def check_image(engine: str, image: str, looking: list[tuple[str, list[bytes]]]) -> list[str]:
    found: list[str] = []
    save = subprocess.Popen([engine, "save", image], stdout=subprocess.PIPE)
    assert save.stdout is not None
    files = 0
    with tarfile.open(fileobj=save.stdout, mode="r|") as archive:
        for member in archive:
            f = archive.extractfile(member) if member.isfile() else None
            if f is not None:
                files += scan(f.read(), member.name, looking, found)
    if save.wait() != 0:
        raise SystemExit(f"{engine} save {image} failed")
    print(
        f"[deploy-test]   {image}: {files} files of its layers, config and history searched", file=sys.stderr
    )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ca", type=Path, required=True, help="the CA bundle given to the build")
    parser.add_argument("--public", type=Path, default=PUBLIC, help="public CAs (*.crt) not to look for")
    parser.add_argument("--engine", default="docker")
    parser.add_argument(
        "--extract", type=Path, help="write the certificates looked for here (PEM), e.g. for a control image"
    )
    parser.add_argument("images", nargs="*")
    args = parser.parse_args()
    looking = needles(args.ca, args.public)
    if not looking:
        print(f"{args.ca}: no certificate but public CAs: nothing to look for", file=sys.stderr)
        sys.exit(2)
    if args.extract:
        pem = [base64.encodebytes(patterns[0]).replace(b"\n", b"") for _, patterns in looking]
        args.extract.write_bytes(
            b"".join(
                b"-----BEGIN CERTIFICATE-----\n"
                + b"\n".join(p[k : k + 64] for k in range(0, len(p), 64))
                + b"\n-----END CERTIFICATE-----\n"
                for p in pem
            )
        )
    if not args.images:
        return
    bad = []
    for image in args.images:
        bad += [f"{image}: {hit}" for hit in check_image(args.engine, image, looking)]
    if bad:
        print("\n".join(f"FOUND: {b}" for b in bad), file=sys.stderr)
        sys.exit(1)
    print(
        f"[deploy-test] none of the {len(looking)} non-public certificates of {args.ca} is in "
        f"{len(args.images)} images (layers, config, history)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
