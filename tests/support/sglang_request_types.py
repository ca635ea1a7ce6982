"""Request bodies built into SGLang's own request types, by one Python of the SGLang virtualenv.

    types = SGLangRequestTypes.start(python)
    assert types.changed_fields("GenerateReqInput", body) == []   # every field accepted, every value kept
    types.close()

SGLang's HTTP handlers decode each JSON body into a dataclass of `sglang.srt.managers.io_struct`, so a field
SGLang renamed or removed is a TypeError there and a value it rewrites shows up as a changed field. Importing
io_struct costs about ten CPU-seconds, so the tests that check bodies share one process (a session fixture,
tests/rollout/conftest.py) that answers one JSON line per body.
"""
from __future__ import annotations

import json
import select
import subprocess
from dataclasses import dataclass

_SERVER = """
import json, sys
from sglang.srt.managers import io_struct
for line in sys.stdin:
    name, body = json.loads(line)
    try:
        obj = getattr(io_struct, name)(**body)
        answer = {"changed": sorted(k for k in body if getattr(obj, k) != body[k])}
    except Exception as exc:
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(answer), flush=True)
"""


@dataclass
class SGLangRequestTypes:
    proc: subprocess.Popen
    timeout_s: float = 300.0

    @classmethod
    def start(cls, python: str) -> SGLangRequestTypes:
        return cls(subprocess.Popen([python, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True))

    def changed_fields(self, type_name: str, body: dict) -> list[str]:
        """The fields of `body` whose value the io_struct type `type_name` does not keep; AssertionError naming
        the type and SGLang's error when it refuses the body."""
        self.proc.stdin.write(json.dumps([type_name, body]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"the SGLang virtualenv's Python gave no answer for {type_name} "
                                 f"(exit status {self.proc.poll()}): {self.proc.stderr.read()[-3000:]}")
        answer = json.loads(line)
        if "error" in answer:
            raise AssertionError(f"SGLang's {type_name} refuses the body: {answer['error']}")
        return answer["changed"]

    def close(self) -> None:
        """Killed: it holds nothing, and an interpreter that imported SGLang takes seconds to exit cleanly."""
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
