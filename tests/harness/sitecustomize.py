"""Test harness for batch workers (subprocesses): on PYTHONPATH only in tests, active only when
``CONVERT_BNB_TEST_PAUSE=NAME:POINT:MARKER`` or ``CONVERT_BNB_TEST_CUT=WHERE:PATH`` is set.

``CONVERT_BNB_TEST_CUT=WHERE:PATH`` truncates the input file PATH to 4096 bytes at the third chunk a
4-bit layer dequantizes: with WHERE ``before``, before the chunk's view of the packed bytes is taken
(the readers' size check sees it), with ``during``, after (the read touches a vanished page: SIGBUS);
with ``rewrite``, before the view, it overwrites the file's last 4096 bytes in place (same size).

With NAME ``import``, the process stops while POINT (a module name, e.g. ``convert.cli``, or
``datetime``, which NumPy's C extension imports) is being imported: it writes its pid to MARKER and
sleeps until the file MARKER.go exists, so a test can signal a command during start-up and then let
the import finish. With NAME ``worker-import``, the same, but only in a spawned ``multiprocessing``
worker (its command line ends with ``--multiprocessing-fork``), e.g. a GGUF encoder process.

Otherwise the worker of job NAME stops at POINT: after its N-th finished shard is recorded in the resumable
staging ledger (POINT is the number N), or right after its output is committed (POINT is ``commit``,
before the batch records the job as done). It writes its pid to MARKER and sleeps until it is
killed, so a test can kill the batch at a known point. Only once: when MARKER already holds a pid,
the worker runs through (a job retried after its worker was killed there, e.g. by Ray). Nothing in the
package knows about this: the harness wraps ``convert.output.ShardLedger.record`` / ``OutputClaim.commit`` from outside.
"""

from __future__ import annotations

import os

_SPEC = os.environ.get("CONVERT_BNB_TEST_PAUSE")
_CUT = os.environ.get("CONVERT_BNB_TEST_CUT")

if _CUT:
    _where, _path = _CUT.split(":", 1)
    _calls = [0]

    def _cut() -> None:
        _calls[0] += 1
        if _calls[0] == 3:
            if _where == "rewrite":  # the same size, other bytes (after a tick of the file system's clock)
                import time

                time.sleep(0.02)
                with open(_path, "r+b") as f:
                    f.seek(-4096, 2)
                    f.write(bytes(4096))
            else:
                os.truncate(_path, 4096)

    if _where in ("before", "rewrite"):
        from convert.stream import sources

        _produce = sources.Dequant4Source.produce_into

        def _cut_then_produce(self: sources.Dequant4Source, *a: object, **k: object) -> None:
            _cut()
            _produce(self, *a, **k)  # type: ignore[arg-type]

        sources.Dequant4Source.produce_into = _cut_then_produce  # type: ignore[method-assign]
    else:
        from convert.dequant import kernels

        _kernel = kernels.dequantize_4bit

        def _cut_then_dequantize(*a: object, **k: object) -> object:
            _cut()
            return _kernel(*a, **k)  # type: ignore[arg-type]

        kernels.dequantize_4bit = _cut_then_dequantize  # type: ignore[assignment]

if _SPEC:
    import time
    from pathlib import Path

    _name, _point, _marker = _SPEC.split(":", 2)

    def _hold(until_go: bool = False) -> None:
        if Path(_marker).exists() and Path(_marker).read_text():
            return  # held once already (and killed there): a retried job runs through
        tmp = Path(f"{_marker}.{os.getpid()}.tmp")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, _marker)  # whole: a test waiting for MARKER never reads it empty
        go = Path(f"{_marker}.go")
        while not (until_go and go.exists()):  # hold here until the test says go, or kills the process
            time.sleep(0.01 if until_go else 3600)

    def _install() -> None:
        from convert import output

        if _point == "commit":
            commit = output.OutputClaim.commit

            def pausing_commit(self: output.OutputClaim) -> None:
                commit(self)
                if self.final.name == _name:
                    _hold()

            output.OutputClaim.commit = pausing_commit  # type: ignore[method-assign]
            return
        record = output.ShardLedger.record

        def pausing_record(self: output.ShardLedger, name: str) -> None:
            record(self, name)
            if output.user_path(self.directory).name == _name and len(self.shards) >= int(_point):
                _hold()

        output.ShardLedger.record = pausing_record  # type: ignore[method-assign]

    class _PauseOnImport:
        """A meta path finder that holds the process when ``_point`` is imported."""

        @staticmethod
        def find_spec(fullname: str, path: object = None, target: object = None) -> None:
            if fullname == _point:
                _hold(until_go=True)
            return None

    if _name in ("import", "worker-import"):
        import sys

        if _name == "import" or sys.argv[-1:] == ["--multiprocessing-fork"]:
            sys.meta_path.insert(0, _PauseOnImport())  # type: ignore[arg-type]
    else:
        _install()
