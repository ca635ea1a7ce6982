"""The program that runs inside the sandbox: set the kernel limits, run the untrusted program, then its tests.

Standard library only, and run as a file by the sandbox's interpreter (`python -I -S -B harness.py`), never
imported by a service. The parent writes one JSON request on stdin:

    {"nonce": str, "rlimits": {"RLIMIT_AS": [soft, hard], ...}, "program": str, "test": str, "entry_point": str}

and reads the verdict from the harness's original stderr (the program's stderr is joined to its stdout, which
the parent reads under a byte limit):

    {"nonce": str, "passed": int, "total": int, "error": str}

The limits are set with setrlimit (soft = hard) before the program's first line runs, so the program cannot
raise them again; the kernel enforces them. The tests follow HumanEval: `test` defines `check(candidate)`;
each top-level statement of its body that contains an `assert` is one test, run on its own (a failure is
recorded and the next one runs); the other statements (setup) run in order, and one that raises fails every
test after it. A program that never returns, kills itself or exits early writes no verdict: the parent then
names the outcome from how the process ended. A program may forge a verdict if it finds the nonce in this
process's memory; docs/sandbox.md says why that is a reward-integrity limit, not an escape.
"""
import ast
import builtins
import json
import os
import resource
import sys


def _has_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def _check_units(test: str) -> tuple[str, list[tuple[bool, ast.Module]]]:
    """check()'s parameter name and its body as (is a test, compiled-ready module), in order."""
    tree = ast.parse(test)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check" and len(node.args.args) == 1:
            return node.args.args[0].arg, [(_has_assert(s), ast.Module(body=[s], type_ignores=[]))
                                           for s in node.body]
    raise ValueError("the test defines no check(candidate)")


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text[:300]


def main() -> None:
    verdict_fd = os.dup(2)
    os.set_inheritable(verdict_fd, False)
    os.dup2(1, 2)  # the program's stderr goes where its stdout goes: one stream under one byte limit
    request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for name, (soft, hard) in request["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    nonce = request["nonce"]
    verdict = {"nonce": nonce, "passed": 0, "total": 0, "error": ""}
    try:
        param, units = _check_units(request["test"])
        verdict["total"] = sum(is_test for is_test, _ in units)
        scope = {"__name__": "solution", "__builtins__": builtins}
        exec(compile(request["program"], "<program>", "exec"), scope)
        exec(compile(request["test"], "<test>", "exec"), scope)
        entry = request["entry_point"]
        if entry not in scope:
            raise NameError(f"the program defines no {entry!r}")
        scope[param] = scope[entry]
        for is_test, unit in units:
            try:
                exec(compile(unit, "<test>", "exec"), scope)
            except Exception as exc:  # noqa: BLE001 - a failing test is a verdict, not a harness error
                verdict["error"] = verdict["error"] or _describe(exc)
                if not is_test:
                    break
            else:
                verdict["passed"] += is_test
    except BaseException as exc:  # noqa: BLE001 - SystemExit and MemoryError from the program are failures too
        verdict["error"] = verdict["error"] or _describe(exc)
        verdict["passed"] = 0
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - a closed or full stdout must not cost the verdict
        pass
    os.write(verdict_fd, json.dumps(verdict).encode())
    os._exit(0)  # no atexit hooks or finalizers of the program's


if __name__ == "__main__":
    main()
