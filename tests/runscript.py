"""run_script(["train.py", ...]): run one of the project's scripts as `python train.py ...` would,
without paying for the imports again.

Why: a fresh interpreter spends ~9 s on a 2-core AVX2 EPYC importing torch and transformers before
a script's first line, and the default suite started Python 108 times: 1056 s of its 1539 s there
(997 s with this helper, in one process). Here each run is a process forked from a server that imported
them once (multiprocessing's forkserver, modules preloaded). It is still a process of its own, as a
user's would be: its own exit status, stdout and stderr, environment, working directory, argv and
sys.path, and it runs its atexit handlers. The forkserver itself never runs a torch op, so no
OpenMP pool exists when it forks; OMP_NUM_THREADS from the run's environment sets torch's threads.

What a fork cannot give: the interpreter's own startup. A run whose environment changes PYTHONPATH
(a sitecustomize), `-c`/`-m`, a test that signals its child, or a platform without forkserver
(Windows) uses subprocess directly.
"""
import atexit
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback

PRELOAD = ["torch", "numpy", "safetensors.torch", "tqdm", "transformers",
           "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto"]
_server = {}


def _fresh_sys_path():
    """sys.path as a fresh interpreter has it, less the script's directory (pytest adds its own)."""
    out = subprocess.check_output([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                                  text=True)
    return json.loads(out)


def _context():
    if not _server:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # torch reads OMP_NUM_THREADS once, at import: the server imports it without the variable
        # (torch's own default), and each run sets its own from its environment (_child)
        saved = os.environ.pop("OMP_NUM_THREADS", None)
        try:
            from multiprocessing import forkserver
            forkserver.ensure_running()
        finally:
            if saved is not None:
                os.environ["OMP_NUM_THREADS"] = saved
        _server.update(ctx=ctx, path=_fresh_sys_path())
    return _server["ctx"], _server["path"]


def _child(argv, cwd, env, sys_path, out_path, err_path):
    """In the forked process: become `python argv[0] argv[1:]` in `cwd` with `env`, run, exit."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    if env.get("OMP_NUM_THREADS"):
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[:] = [os.path.dirname(os.path.realpath(script))] + sys_path
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    # the interpreter's exit: wait for non-daemon threads, then the atexit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    if code is None:
        code = 0
    elif not isinstance(code, int):       # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code & 0xFF)


def run_script(argv, cwd=None, env=None, timeout=300):
    """subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), with argv[0] a .py script: a CompletedProcess, or TimeoutExpired."""
    argv = [str(a) for a in argv]
    cwd = os.getcwd() if cwd is None else str(cwd)
    env = dict(os.environ if env is None else env)
    cmd = [sys.executable, *argv]
    if (not argv[0].endswith(".py") or env.get("PYTHONPATH") != os.environ.get("PYTHONPATH")
            or "forkserver" not in multiprocessing.get_all_start_methods()):   # e.g. Windows
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    ctx, sys_path = _context()
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        for path in (out, err):             # there to read even if the child died before writing
            open(path, "w").close()
        p = ctx.Process(target=_child, args=(argv, cwd, env, sys_path, out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(cmd, timeout)
        with open(out, encoding="utf-8", errors="replace") as f, \
                open(err, encoding="utf-8", errors="replace") as g:
            return subprocess.CompletedProcess(cmd, p.exitcode, f.read(), g.read())
