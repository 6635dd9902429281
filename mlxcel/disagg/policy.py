"""The router's pick and retry decisions over plain data (docs/disagg.md §6).

No sockets, threads, clocks or locks: ``RoutePolicy`` reads node health through an ``is_up``
predicate and a failed attempt through its counts, and answers with a decision the router acts on.
Its state is one round-robin cursor per role and, with prefix routing, the prefix index, so the router
calls it under its own lock.

- ``pick(is_up, key, load)``: ``Route(prefill, decode)``, or ``NoneUp(role)`` when no node of a role is up
  (the request is refused: 503 + Retry-After). With a prefix index (``--route-policy prefix``) and a
  prompt's ``key``, the prefill node is ``mlxcel.disagg.prefix_routing.choose``'s; else round-robin.
- ``after_failure(code, ...)``: ``Route`` (fail over to those nodes), ``NoneUp`` (fail over wanted,
  nobody to take it: the request fails UNAVAILABLE) or ``GiveUp(code)`` (the request fails with it).
- ``depends_on(peer, ...)``: whether an attempt is lost when ``peer`` goes down or restarts.
- ``may_resume(code, policy, ...)``: whether a failed request is resumed instead (docs/disagg.md §6.1): the
  error classes here, the bounds the engine's ``ResumePolicy`` (shared with the scheduler).
- ``node_failure(code, ...)``: the failure a node's reported code makes of an attempt (its CANCELLED: INTERNAL).

Failover happens only before the first token reaches the client, for at most ``max_attempts``
attempts in all, never while the router shuts down, and never for a bad-input or cancelled code.
A request failover does not take (tokens were streamed, no node is up now, the attempts are spent) is
resumed: at most ``max_resumes`` times, never while shutting down, never for a bad-input or cancelled
code, and only if its prompt plus the tokens streamed still fit the context for a re-prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Sequence, TypeVar, Union

from mlxcel.disagg.prefix_routing import DEFAULT_LOAD_SLACK, PrefixIndex, PromptKey, choose
from mlxcel.disagg.wire import MAX_DISPATCH_ATTEMPTS
from mlxcel.engine.resume_policy import ResumePolicy
from mlxcel.error_codes import CodedError, ErrorClass, ErrorCode

Node = TypeVar("Node", bound=Hashable)
ROLES = ("prefill", "decode")
NO_RETRY = (ErrorClass.BAD_INPUT, ErrorClass.CANCELLED)  # about the request itself, or nobody wants it


@dataclass(frozen=True)
class Route(Generic[Node]):
    """Send the attempt to these two nodes (GENERATE to ``prefill`` with ``decode_target=decode``)."""

    prefill: Node
    decode: Node
    matched: int = 0  # prefix blocks of the prompt ``prefill`` is expected to hold (prefix-aware picks)


@dataclass(frozen=True)
class NoneUp:
    """No node of ``role`` is up: the request fails (or is refused) as unavailable."""

    role: str
    code: ErrorCode = ErrorCode.UNAVAILABLE


@dataclass(frozen=True)
class GiveUp:
    """No failover: the request ends with ``code``."""

    code: ErrorCode


Pick = Union[Route[Node], NoneUp]
Decision = Union[Route[Node], NoneUp, GiveUp]


def may_retry(code: ErrorCode, *, attempts: int, emitted: int, closing: bool,
              max_attempts: int = MAX_DISPATCH_ATTEMPTS) -> bool:
    """Whether a failed attempt (``attempts`` made so far, ``emitted`` tokens relayed) goes to other nodes."""
    return not closing and emitted == 0 and attempts < max_attempts and code.error_class not in NO_RETRY


def may_resume(code: ErrorCode, policy: ResumePolicy, *, resumes: int, closing: bool, tokens: int, prompt: int,
               max_tokens: int, context_length: int) -> bool:
    """Whether a failed request (``resumes`` made, ``tokens`` streamed after a ``prompt``-token prompt) is
    resumed: prefilled again with prompt + tokens on nodes that are up (waiting for one if none is). Its
    bounds are the scheduler's (``ResumePolicy.allows``); the router adds its error classes, shutdown and
    tokens left to generate."""
    return (not closing and code.error_class not in NO_RETRY and tokens < max_tokens
            and policy.allows(resumes, prompt + tokens, context_length))


def final_code(code: ErrorCode) -> ErrorCode:
    """The code a request fails with: a node's bad-input code is the client's (400), any other is ours."""
    return code if code.error_class is ErrorClass.BAD_INPUT else code.as_local()


def node_failure(code: ErrorCode, message: str, node: str) -> CodedError:
    """What a node's ERROR (or FINISH with a code) fails its live attempt with: its own code, except CANCELLED.
    Only the router cancels a request, and one whose client went away is over before any node's answer is
    read, so a node's CANCELLED is that node's failure (INTERNAL): failed over, resumed, else 500, never 499."""
    if code.error_class is ErrorClass.CANCELLED:
        return CodedError(f"{node} cancelled the request on its own ({message or 'no reason given'})",
                          ErrorCode.INTERNAL, peer_code=code)
    return CodedError(message, code)


def depends_on(peer: Node, *, prefill: Node | None, decode: Node | None, handed_off: bool) -> bool:
    """Whether an attempt on ``prefill``/``decode`` is lost with ``peer``: its decode node, or its
    prefill node until the KV cache was handed off."""
    return decode == peer or (prefill == peer and not handed_off)


class RoundRobin(Generic[Node]):
    """Round-robin over one role's nodes in configuration order, skipping those not up."""

    def __init__(self, nodes: Sequence[Node]):
        self.nodes = list(nodes)
        self.cursor = 0  # the index the next pick starts from

    def next(self, is_up: Callable[[Node], bool]) -> Node | None:
        """The first node up from the cursor on (the cursor moves past it), or None (it stays)."""
        for k in range(len(self.nodes)):
            i = (self.cursor + k) % len(self.nodes)
            if is_up(self.nodes[i]):
                self.cursor = (i + 1) % len(self.nodes)
                return self.nodes[i]
        return None


class RoutePolicy(Generic[Node]):
    """Which nodes an attempt goes to, and what a failed attempt leads to."""

    def __init__(self, prefill: Sequence[Node], decode: Sequence[Node], *,
                 max_attempts: int = MAX_DISPATCH_ATTEMPTS, prefix: PrefixIndex[Node] | None = None,
                 slack: int = DEFAULT_LOAD_SLACK):
        self.rings = {"prefill": RoundRobin(prefill), "decode": RoundRobin(decode)}
        self.max_attempts = max_attempts
        self.prefix = prefix  # None: round-robin (--route-policy round-robin)
        self.slack = slack

    def pick(self, is_up: Callable[[Node], bool], key: PromptKey | None = None,
             load: Callable[[Node], int] = lambda node: 0) -> Pick[Node]:
        """A prefill and a decode node; both cursors move even if the other role has none. The prefill node is
        the prefix-aware choice given a prefix index and ``key`` (``load``: a node's attempts not handed off),
        else the next one up; the decode node the next one up."""
        prefill, matched = self._prefill(is_up, key, load)
        decode = self.rings["decode"].next(is_up)
        if prefill is None:
            return NoneUp("prefill")
        if decode is None:
            return NoneUp("decode")
        return Route(prefill, decode, matched)

    def _prefill(self, is_up: Callable[[Node], bool], key: PromptKey | None,
                 load: Callable[[Node], int]) -> tuple[Node | None, int]:
        ring = self.rings["prefill"]
        if self.prefix is None or key is None:
            return ring.next(is_up), 0
        choice = choose([n for n in ring.nodes if is_up(n)], self.prefix, key, load,
                        lambda eligible: ring.next(lambda n: is_up(n) and eligible(n)), self.slack)
        return (None, 0) if choice is None else (choice.node, choice.matched)

    def after_failure(self, code: ErrorCode, *, attempts: int, emitted: int, closing: bool,
                      is_up: Callable[[Node], bool]) -> Decision[Node]:
        """What follows a failed attempt: nodes to fail over to, or how the request ends."""
        if may_retry(code, attempts=attempts, emitted=emitted, closing=closing, max_attempts=self.max_attempts):
            return self.pick(is_up)
        return GiveUp(final_code(code))
