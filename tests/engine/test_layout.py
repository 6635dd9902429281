"""The engine's rooms (issue 41): the request table stands apart from the thread and the compute, and
no module of ``mlxcel/engine`` grows past 600 lines.

``engine/requests.py`` holds the request records and their state machine; it imports neither the
executor nor the scheduler (not even through another module) and runs no thread and takes no lock, so
the scheduler and the resume object (``engine/resume.py``) share one table that can be tested alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_graph import PACKAGE, import_graph

ENGINE = PACKAGE / "engine"
MAX_LINES = 600


def reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def imported_names(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports (``threading`` for ``from threading import Lock``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_request_table_imports_neither_the_executor_nor_the_scheduler():
    graph = import_graph(PACKAGE)
    assert "mlxcel.engine.requests" in graph, "mlxcel/engine/requests.py is missing"
    reached = reachable(graph, "mlxcel.engine.requests")
    assert not reached & {"mlxcel.engine.executor", "mlxcel.engine.scheduler", "mlxcel.engine.resume"}, reached


def test_the_request_table_runs_no_thread_and_takes_no_lock():
    source = (ENGINE / "requests.py").read_text(encoding="utf-8")
    assert not imported_names(ENGINE / "requests.py") & {"threading", "queue", "concurrent", "asyncio"}
    assert "Lock(" not in source and "Thread(" not in source


def test_resume_uses_the_table_and_not_the_scheduler():
    graph = import_graph(PACKAGE)
    assert "mlxcel.engine.requests" in graph["mlxcel.engine.resume"]
    assert "mlxcel.engine.scheduler" not in reachable(graph, "mlxcel.engine.resume")


def test_no_engine_module_is_over_600_lines():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted(ENGINE.glob("*.py"))}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_scheduler_probes_no_executor_hook():
    """Every hook is declared on ``ExecutorBase`` with its default: the scheduler calls, never ``getattr``."""
    for name in ("scheduler.py", "resume.py"):
        tree = ast.parse((ENGINE / name).read_text(encoding="utf-8"))
        probes = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None)
                  in ("getattr", "hasattr") and "executor" in ast.unparse(n.args[0])]
        assert probes == [], f"{name} probes the executor at lines {probes}"


def test_every_executor_derives_from_executor_base():
    from mlxcel.engine.executor import ExecutorBase, LocalExecutor
    from mlxcel.parallel.executor import TPExecutor
    from mlxcel.pipeline.coordinator import PipelineExecutor
    from tests.engine.fakes import FakeExecutor

    for cls in (LocalExecutor, PipelineExecutor, TPExecutor, FakeExecutor):
        assert issubclass(cls, ExecutorBase), cls.__name__


def test_executor_base_declares_every_hook_with_its_default():
    """An executor that only prepares, submits and releases: no resuming, no adopting, synchronous steps,
    spread micro-batches, and a cancel that is a release without tokens."""
    from mlxcel.engine.executor import ExecutorBase
    from mlxcel.engine.scheduler import Scheduler
    from tests.engine.fakes import FakeTokenizer

    class Minimal(ExecutorBase):
        depth, micro_batch_size = 1, 2

        def __init__(self) -> None:
            self.released: list[tuple[str, object]] = []

        def release(self, rid, tokens=None):
            self.released.append((rid, tokens))

    ex = Minimal()
    assert (ex.start_async(), ex.poll(), ex.resumable(OSError("down")), ex.check_peers()) == (0, False, False, None)
    assert (ex.fill_micro_batches, ex.resume_policy, ex.adopts) == (False, None, False)
    assert ex.stats() == {} and ex.health() == {"status": "ok"}
    ex.cancel("r1")
    assert ex.released == [("r1", None)]
    sched = Scheduler(ex, FakeTokenizer(), context_length=64, warmup=False)
    assert sched.resume is None
    try:
        sched.submit_prefilled(object(), object(), object())  # type: ignore[arg-type]
    except TypeError as exc:
        assert "adopt" in str(exc)
    else:
        raise AssertionError("submit_prefilled over an executor that cannot adopt")
