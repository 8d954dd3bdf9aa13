"""What tool code can see of the host (megarl/envs/sandbox.py): only what its interpreter needs.

Run as an ordinary user -- the normal case on a cluster, where the leak happened: a user made here
(CI runs as root) with a credential in their home (~/.netrc, ~/.ssh/id_ed25519), a venv in that
home whose numpy the tool code imports, and a world-readable data file with answers and a
checkpoint outside any home and outside /tmp. The same probe run by that user *outside* the
sandbox reads every planted file (the control); inside it reads none, while numpy still imports.
Then the same checks as root (the sandbox drops to an unused uid), and the config rule for extra
read-only mounts (an environment's fixtures). Last, the limits that depend on who runs it, for the
user (busy with more processes than the sandbox may have) and for root: a fork bomb, filling
/dev/shm and /dev, and creating a user namespace.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megarl.config import collect_problems, load_config
from megarl.envs.sandbox import SANDBOX_ENV, SANDBOX_HOME, SandboxLimits, interpreter, interpreter_mounts, run_python

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml"
LIMITS = SandboxLimits(cpu_s=20, wall_s=60.0, memory_mb=2048, output_bytes=1 << 20)
SECRET = "SECRET-7f3a"           # in every planted file: must never reach the sandbox's output
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"   # util-linux: run a command as a user
SECRET_ENV = {"WANDB_API_KEY": SECRET + "-env", "AWS_SECRET_ACCESS_KEY": SECRET + "-env"}

# Run inside the sandbox (and, as the control, outside it): what it can read, list, import, see.
PROBE = r'''
import json, os, sys
def read(p):
    try:
        with open(p) as f:
            return f.read()
    except OSError as e:
        return "ERR " + type(e).__name__
def ls(p):
    try:
        return sorted(os.listdir(p))
    except OSError as e:
        return "ERR " + type(e).__name__
def write(p):
    try:
        with open(p, "w") as f:
            f.write("x")
        return "WROTE"
    except OSError as e:
        return "ERR " + type(e).__name__
ARGS = json.loads(%r)
visible = []          # every path outside ARGS["allowed"] that exists (pruned at allowed mounts)
if ARGS["walk"]:
    for top, dirs, files in os.walk("/"):
        keep = []
        for d in dirs:
            p = os.path.join(top, d)
            if not any(p == a or p.startswith(a + "/") for a in ARGS["allowed"]):
                keep.append(d)
        dirs[:] = keep
        visible += [os.path.join(top, n) for n in dirs + files
                    if not any(os.path.join(top, n) == a or os.path.join(top, n).startswith(a + "/")
                               for a in ARGS["allowed"])]
procs = {}
for pid in (ls("/proc") if not isinstance(ls("/proc"), str) else []):
    if pid.isdigit():
        procs[pid] = read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
try:
    import numpy
    np_sum = int(numpy.arange(4).sum())
except Exception as e:
    np_sum = "ERR " + repr(e)
print(json.dumps({"reads": {p: read(p) for p in ARGS["read"]}, "ls": {p: ls(p) for p in ARGS["ls"]},
                  "writes": {p: write(p) for p in ARGS["write"]},
                  "env": dict(os.environ), "uid": os.getuid(), "numpy": np_sum, "visible": visible[:200],
                  "procs": procs}))
'''


# Run inside the sandbox (and, as the control, outside it): how many of ``forks`` forks succeed (all
# alive at once), whether a POSIX semaphore can be made, how much of ``chunk``-byte files each
# ``fill`` directory takes, and whether a new user namespace can be made (through ctypes:
# os.unshare is Python 3.12+). The namespace comes last: on success the probe itself is in it.
LIMITS_PROBE = r'''
import ctypes, errno, json, os
ARGS = json.loads(%r)
def forks(n):
    ok, errors, kids = 0, set(), []
    r, w = os.pipe()
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError as e:
            errors.add(type(e).__name__ + " " + errno.errorcode[e.errno])
            continue
        if pid == 0:                       # each child waits until the parent closes the pipe
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        ok += 1
        kids.append(pid)
    os.close(w)
    for pid in kids:
        os.waitpid(pid, 0)
    return {"ok": ok, "errors": sorted(errors)}
def fill(d):
    wrote = 0
    for i in range(ARGS["files"]):
        try:
            with open(os.path.join(d, f"fill{i}"), "wb") as f:
                f.write(b"x" * ARGS["chunk"])
        except OSError as e:
            return {"mb": wrote / 2**20, "error": errno.errorcode[e.errno]}
        wrote += ARGS["chunk"]
    return {"mb": wrote / 2**20, "error": None}
def semaphore():                           # what multiprocessing's locks and pools need of /dev/shm
    import multiprocessing
    try:
        multiprocessing.Lock()
    except OSError as e:
        return errno.errorcode[e.errno]
    return "made"
out = {"forks": forks(ARGS["forks"]), "semaphore": semaphore(), "fill": {d: fill(d) for d in ARGS["fill"]}}
libc = ctypes.CDLL(None, use_errno=True)
out["userns"] = "made" if libc.unshare(0x10000000) == 0 else errno.errorcode[ctypes.get_errno()]   # CLONE_NEWUSER
print(json.dumps(out))
'''


def limits_code(limits: SandboxLimits, fill: list[str] = (), forks: int = 200) -> str:
    """The limits probe: ``forks`` forks, and files of half the file-size cap into ``fill`` until
    twice ``tmp_mb`` is written."""
    chunk = limits.output_bytes // 2
    return LIMITS_PROBE % json.dumps({"forks": forks, "fill": list(fill), "chunk": chunk,
                                      "files": 2 * (limits.tmp_mb << 20) // chunk})


def probe_code(read: list[str], ls: list[str] = (), allowed: list[str] = (), walk: bool = False,
               write: list[str] = ()) -> str:
    return PROBE % json.dumps({"read": read, "ls": list(ls), "allowed": list(allowed), "walk": walk,
                               "write": list(write)})


def sh(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=120, **kw)


def write(path: Path, text: str, mode: int, owner: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    if owner:
        shutil.chown(path, owner, owner)
    return path


@pytest.fixture(scope="module")
def host():
    """An ordinary user with a credential-laden home and a numpy venv in it, plus world-readable
    data, checkpoint and fixtures under /var/tmp (not /tmp, which every sandbox replaces anyway)."""
    if os.geteuid() != 0:
        pytest.skip("creates an ordinary user (useradd): run as root, as CI does")
    name = f"mrlsbx{os.getpid()}"
    sh("useradd", "-m", "-s", "/bin/sh", name)
    planted = Path(tempfile.mkdtemp(prefix="megarl-planted-", dir="/var/tmp"))
    try:
        planted.chmod(0o755)
        home = Path(pwd.getpwnam(name).pw_dir)
        h = {"netrc": write(home / ".netrc", f"machine api.wandb.ai login user password {SECRET}\n", 0o600, name),
             "ssh": write(home / ".ssh" / "id_ed25519", f"-----BEGIN OPENSSH PRIVATE KEY-----\n{SECRET}\n", 0o600, name),
             "wandb": write(home / ".config" / "wandb" / "settings", f"[default]\napi_key = {SECRET}\n", 0o644, name),
             "data": write(planted / "data" / "train.jsonl", json.dumps({"prompt": "2+2?", "answer": SECRET}) + "\n",
                           0o644),
             "ckpt": write(planted / "outputs" / "checkpoints" / "step_10" / "model.safetensors", SECRET, 0o644),
             "fixture": write(planted / "env" / "fixtures" / "table.txt", "fixture-ok", 0o644),
             "answers": write(planted / "env" / "answers.jsonl", SECRET, 0o644)}
        for d in [planted / "data", planted / "outputs", planted / "outputs" / "checkpoints",
                  planted / "outputs" / "checkpoints" / "step_10", planted / "env", planted / "env" / "fixtures"]:
            d.chmod(0o755)
        shutil.chown(home / ".ssh", name, name)
        (home / ".ssh").chmod(0o700)
        # the user's own venv (Debian's python3) holding numpy: copied from this interpreter's
        # install (same cp311 ABI), the way `pip install numpy` would lay it out
        venv = home / "venv"
        sh(RUNUSER, "-u", name, "--", "/usr/bin/python3", "-m", "venv", "--without-pip", str(venv))
        site = Path(sh(RUNUSER, "-u", name, "--", str(venv / "bin" / "python"), "-c",
                       "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
        import numpy

        src = Path(numpy.__file__).parent
        for part in [src, src.with_name("numpy.libs")]:
            if part.exists():
                shutil.copytree(part, site / part.name, ignore=shutil.ignore_patterns("__pycache__", "tests"))
        sh("chown", "-R", f"{name}:{name}", str(venv))
        # the sandbox code as the user can read it (a clone under /root would not be)
        code = planted / "code"
        shutil.copytree(ROOT / "megarl", code / "megarl", ignore=shutil.ignore_patterns("__pycache__"))
        sh("chmod", "-R", "a+rX", str(code))
        yield {"name": name, "home": home, "venv": venv, "planted": planted, "code": code, **h}
    finally:
        subprocess.run(["userdel", "-r", name], capture_output=True)
        shutil.rmtree(planted, ignore_errors=True)


def as_user(host, code: str, sandboxed: bool, mounts: list[str] = (), limits: SandboxLimits = LIMITS) -> dict:
    """Run ``code`` as the ordinary user with their venv's python: through ``run_python`` under
    ``limits`` (the user's process starts the sandbox, as on a cluster) or directly (the control)."""
    python = str(host["venv"] / "bin" / "python")
    driver = ("import json, sys\nfrom megarl.envs.sandbox import SandboxLimits, interpreter, run_python\n"
              "a = json.loads(sys.argv[1])\n"
              "r = run_python(a['code'], SandboxLimits(**a['limits']), a['python'], a['mounts'])\n"
              "print(json.dumps({'stdout': r.stdout, 'stderr': r.stderr, 'rc': r.exit_code,\n"
              "                  'mounts': interpreter(a['python']).mounts}))\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(host["home"]), "PYTHONPATH": str(host["code"]), **SECRET_ENV}
    if sandboxed:
        arg = json.dumps({"code": code, "python": python, "mounts": list(mounts),
                          "limits": dataclasses.asdict(limits)})
        r = subprocess.run([RUNUSER, "-u", host["name"], "--", python, "-c", driver, arg], capture_output=True,
                           text=True, timeout=180, env=env, cwd="/")
        assert r.returncode == 0, r.stderr[-3000:]
        outer = json.loads(r.stdout)
        assert outer["rc"] == 0, outer["stderr"][-3000:]
        return {**json.loads(outer["stdout"]), "mounts": outer["mounts"], "raw": outer["stdout"]}
    r = subprocess.run([RUNUSER, "-u", host["name"], "--", python, "-I", "-c", code], capture_output=True,
                       text=True, timeout=180, env=env, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return {**json.loads(r.stdout), "raw": r.stdout}


def planted_files(host) -> list[str]:
    return [str(host[k]) for k in ("netrc", "ssh", "wandb", "data", "ckpt", "answers")] + [str(ROOT / "README.md")]


def assert_sees_only_its_interpreter(out: dict, mounts: list[str], expect_uid: int) -> None:
    assert out["numpy"] == 6, out["numpy"]                       # the interpreter's packages work
    assert SECRET not in out["raw"]
    assert all(v == "ERR FileNotFoundError" for v in out["reads"].values()), out["reads"]
    assert out["uid"] == expect_uid
    # a fixed minimal environment: nothing of the caller's (its secrets included)
    assert set(out["env"]) <= set(SANDBOX_ENV) | {"PATH", "PWD", "LC_CTYPE"}, sorted(out["env"])
    assert out["env"]["HOME"] == SANDBOX_HOME
    # its own /proc: only the sandbox's processes, none of the host's (pytest, runuser, init)
    assert out["procs"] and all(("python" in c or "setpriv" in c or "bwrap" in c) and "pytest" not in c
                                and "runuser" not in c for c in out["procs"].values()), out["procs"]
    # everything it can see beyond /usr, /proc, /dev, /tmp and the interpreter's mounts is a bare
    # directory leading to one of those mounts, or the dynamic linker's cache
    ancestors = {str(p) for m in [*mounts, "/etc/ld.so.cache"] for p in Path(m).parents}
    extra = [p for p in out["visible"] if p not in ancestors and p != "/etc/ld.so.cache"]
    assert not extra, extra


ALLOWED_BASE = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/dev", "/tmp"]


def test_ordinary_user_tool_code_reads_no_credential_data_or_checkpoint(host):
    # control: the user can read every planted file outside the sandbox
    control = as_user(host, probe_code(planted_files(host)), sandboxed=False)
    for path, text in control["reads"].items():
        assert SECRET in text or path.endswith("README.md"), (path, text)
    assert control["numpy"] == 6 and control["env"]["WANDB_API_KEY"] == SECRET_ENV["WANDB_API_KEY"]

    mounts = as_user(host, probe_code([]), sandboxed=True)["mounts"]
    # exactly the venv in the home, never the home itself; the base python is under /usr
    assert mounts == [str(host["venv"])], mounts
    out = as_user(host, probe_code(planted_files(host), ls=[str(host["home"]), "/home"],
                                   allowed=ALLOWED_BASE + mounts, walk=True), sandboxed=True)
    assert_sees_only_its_interpreter(out, mounts, pwd.getpwnam(host["name"]).pw_uid)
    assert out["ls"] == {str(host["home"]): ["venv"], "/home": [host["name"]]}


def test_root_tool_code_reads_no_world_readable_data_or_checkpoint(host, monkeypatch):
    for k, v in SECRET_ENV.items():
        monkeypatch.setenv(k, v)
    world_readable = [str(host[k]) for k in ("wandb", "data", "ckpt", "answers")]
    assert all(os.stat(p).st_mode & 0o004 for p in world_readable)   # any uid could read them on the host
    mounts = list(interpreter(sys.executable).mounts)
    assert not any(m in ("/", "/root", "/home", str(host["home"])) for m in mounts), mounts
    r = run_python(probe_code(planted_files(host), ls=["/home"], allowed=ALLOWED_BASE + mounts, walk=True), LIMITS)
    assert r.exit_code == 0, r.stderr[-3000:]
    out = {**json.loads(r.stdout), "raw": r.stdout}
    uid = out["uid"]
    assert uid >= 61000                                            # dropped to an unused uid
    assert_sees_only_its_interpreter(out, mounts, uid)


def test_extra_mounts_show_fixtures_read_only_and_nothing_beside_them(host):
    fixtures = str(host["fixture"].parent)
    code = probe_code([str(host["fixture"]), str(host["answers"])], write=[str(host["fixture"])])
    for out in (json.loads(run_python(code, LIMITS, mounts=[fixtures]).stdout),   # as root
                as_user(host, code, True, [fixtures])):                         # as the user
        assert out["reads"] == {str(host["fixture"]): "fixture-ok", str(host["answers"]): "ERR FileNotFoundError"}
        assert out["writes"] == {str(host["fixture"]): "ERR OSError"}, out["writes"]
    assert host["fixture"].read_text() == "fixture-ok"
    with pytest.raises(ValueError, match="home directory"):
        run_python("print(1)", LIMITS, mounts=[str(host["home"])])


def test_interpreter_mounts_never_take_a_home_whole(host):
    """A Python whose prefix *is* a home (installed with --prefix=$HOME) is mounted by its stdlib
    and site-packages directories only; a venv in a home by the venv alone."""
    home = str(host["home"])
    lib = host["venv"] / "lib"
    got = interpreter_mounts(f"{home}/venv/bin/python", home, "/usr", [str(p) for p in lib.glob("python3*/site-packages")])
    assert home not in got and all(g.startswith(str(lib)) for g in got if g.startswith(home)), got
    assert interpreter_mounts(f"{home}/venv/bin/python", f"{home}/venv", "/usr", []) == (f"{home}/venv",)


def test_config_names_the_mounts_field(tmp_path):
    base = ["agent.enabled=true", "agent.env=python", "agent.tool_timeout_s=20", "data.path=/srv/d/train.jsonl",
            "data.source=jsonl", f"output_dir={tmp_path}/out"]

    def problems(mounts):
        cfg = load_config(DEFAULT, base + [f"agent.env_args={json.dumps({'mounts': mounts})}"], validate=False)
        return [p for p in collect_problems(cfg) if p.startswith("agent.env_args.mounts")]

    assert problems(["/srv/fixtures"]) == []
    assert problems(["fixtures"]) == ["agent.env_args.mounts: 'fixtures' is not an absolute path"]
    assert "data.path" in problems(["/srv/d"])[0]                       # the folder holding the answers
    assert "output_dir" in problems([str(tmp_path)])[0]                  # outputs, checkpoints
    assert "a home directory" in " ".join(problems(["/"]))
    assert "a home directory" in problems(["/home"])[0]
    assert problems("/srv/x")[0].startswith("agent.env_args.mounts: must be a list of absolute paths")
    cfg = load_config(DEFAULT, base + [f"agent.env_args={json.dumps({'mounts': [str(tmp_path / 'nope')]})}"],
                      validate=False)
    assert f"agent.env_args.mounts: {str(tmp_path / 'nope')!r} does not exist" in collect_problems(cfg, check_paths=True)


SMALL = dataclasses.replace(LIMITS, nproc=16, tmp_mb=4)


def assert_limits_hold(out: dict, limits: SandboxLimits) -> None:
    """A fork bomb gets EAGAIN near ``nproc`` (the interpreter and bubblewrap's reaper count too),
    /dev/shm holds semaphores but at most ``tmp_mb``, the rest of /dev nothing, and no user
    namespace is made."""
    forks = out["forks"]
    assert limits.nproc // 2 <= forks["ok"] < limits.nproc, forks
    assert forks["errors"] == ["BlockingIOError EAGAIN"], forks
    assert out["semaphore"] == "made", out["semaphore"]
    shm, dev = out["fill"]["/dev/shm"], out["fill"]["/dev"]
    assert shm["error"] in ("ENOSPC", "EROFS") and shm["mb"] <= limits.tmp_mb, shm
    assert dev["error"] in ("EROFS", "EACCES") and dev["mb"] == 0, dev
    assert out["userns"] in ("ENOSPC", "EPERM"), out["userns"]


def test_ordinary_user_sandbox_limits_processes_dev_shm_and_user_namespaces(host):
    """As the user: RLIMIT_NPROC counts every process of a uid, and the user here already runs more
    than the sandbox may have; the sandbox's code still gets about ``nproc`` and no more."""
    control = as_user(host, limits_code(SMALL), sandboxed=False)
    assert control["forks"] == {"ok": 200, "errors": []} and control["userns"] == "made", control
    busy: list[subprocess.Popen] = []
    try:
        for _ in range(3 * SMALL.nproc):
            busy.append(subprocess.Popen(["sleep", "600"], user=host["name"], group=host["name"], extra_groups=[]))
        out = as_user(host, limits_code(SMALL, fill=["/dev/shm", "/dev"]), sandboxed=True, limits=SMALL)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert_limits_hold(out, SMALL)


def test_root_sandbox_limits_processes_dev_shm_and_user_namespaces():
    """As root (CI): bwrap mounts as root, the code runs as an unused uid in a second bwrap's user
    namespace. (Run by an ordinary user, this checks that user's path again.)"""
    r = run_python(limits_code(SMALL, fill=["/dev/shm", "/dev"]), SMALL)
    assert r.exit_code == 0, r.stderr[-3000:]
    assert_limits_hold(json.loads(r.stdout), SMALL)
