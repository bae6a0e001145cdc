"""DeepSpeed hostfiles ('host slots=N' per line): the node list a multi-node deepspeed launch
takes its node count and master address from."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import UserInputError


def read_hostfile(path: Path) -> list[str]:
    """The hosts of a DeepSpeed hostfile ('host slots=N' per line; '#' comments and blank lines
    skipped), in order: the first one is the master."""
    if not path.is_file():
        raise UserInputError(f"--hostfile {path}: no such file")
    hosts = [
        line.split("#", 1)[0].split()[0]
        for line in path.read_text().splitlines()
        if line.split("#", 1)[0].strip()
    ]
    if not hosts:
        raise UserInputError(f"--hostfile {path}: no hosts; write one 'host slots=N' line per node")
    return hosts


def hostfile_layout(path: Path, nnodes: str | None, master_addr: str | None) -> tuple[str, str]:
    """(--nnodes, --master-addr) for a deepspeed launch over `path`: the node count is the file's
    and the master its first host, unless given; a node count the file contradicts is an error."""
    hosts = read_hostfile(path)
    if nnodes is not None and nnodes != str(len(hosts)):
        raise UserInputError(
            f"--nnodes {nnodes}, but --hostfile {path} lists {len(hosts)} host(s) ({', '.join(hosts)}); "
            "drop --nnodes (the hostfile decides) or fix the hostfile"
        )
    return str(len(hosts)), master_addr or hosts[0]
