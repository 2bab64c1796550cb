"""What a node agent's domain membership tells its DRA driver about one GPUDomain: the two mechanisms meet here
(mechanisms stay independent of one another), the node agent role wiring one to the other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class DomainNotReady(Exception):
    """This node is not (yet) a Ready member of the domain: a retryable prepare error, the reason in its text."""


@dataclass(frozen=True)
class MemberView:
    """This node as the domain's folded status shows it, once Ready."""
    namespace: str
    domain: str
    uid: str
    index: int
    clique: str
    view_dir: Path  # host folder holding the domain's peer list (kept current by the membership)
