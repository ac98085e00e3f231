"""Collectives in compiled HLO text, with the op_name metadata that says what they serve."""
import re

COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                        r"(?:-start)?\(")


def hlo_collectives(hlo: str) -> list[tuple[str, str]]:
    """(kind, op_name metadata) of every collective in compiled HLO text."""
    out = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            name = re.search(r'op_name="([^"]*)"', line)
            out.append((m.group(1), name.group(1) if name else ""))
    return out
