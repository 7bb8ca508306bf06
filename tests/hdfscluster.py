"""A live HDFS for tests: Hadoop's NameNode and DataNode on 127.0.0.1, built from PyPI artifacts.

Nothing needs installing beyond a JDK (``jni.h`` and ``libjvm``) and gcc:

* Hadoop 2.7.3's server and client jars ship inside the source distribution of
  ``pyspark==2.4.8`` (``deps/jars``); the 55 that a NameNode, a DataNode and a libhdfs client
  load are unpacked from it.
* libhdfs's C sources ship inside the source distribution of ``pydoop==2.0.0``; they are built
  into ``libhdfs.so`` against the JDK with gcc (seven files, under a second).

Both sdists are fetched with pip from PyPI once per machine and cached under
``~/.cache/raying-hdfs`` (``RAYING_HDFS_CACHE`` moves it); what is kept is the jars (~37 MB),
the C sources and one ``libhdfs.so`` per JDK, not the 220 MB sdist. Their ``setup.py`` files
predate current setuptools (they import ``pkg_resources``), so pip runs them in a small helper
environment with ``setuptools<70`` and ``--no-build-isolation``; pip must run them even to
download, to read the package metadata.

A cluster (:class:`HDFSCluster`) gets a folder of its own: a loopback-only configuration on free
ports, the NameNode's metadata, the DataNode's blocks, logs. ``start()`` formats the NameNode,
starts one JVM each (``-Xmx256m``) and returns once the DataNode's first block report has
reached the NameNode (a client could otherwise be told there is no DataNode to write to).
``stop()`` ends both by PID (also run at interpreter exit, should a run be interrupted).

The client (pyarrow's ``HadoopFileSystem`` -> ``libhdfs.so`` -> JNI -> Hadoop's client jars) needs
``JAVA_HOME``, ``ARROW_LIBHDFS_DIR`` and an explicit ``CLASSPATH`` (JNI does not expand
``dir/*``): :attr:`HDFSCluster.client_env`. The configuration folder is on that CLASSPATH, so
the client reads its settings from the same ``hdfs-site.xml``: it gives up on an unreachable
DataNode after tens of milliseconds instead of seconds, so that raying's own retries, not the
Hadoop client's, ride out an outage (and are counted).

Fixtures (registered in tests/conftest.py):
    hdfs_cluster  session-scoped running HDFSCluster; skips, printing why, where no JDK or no
                  gcc is found (fails instead with RAYING_TEST_HDFS=require, as CI sets).
    hdfs          the same cluster, with the client environment set for as long as the
                  requesting module's tests run (module scope), so that a Ray started after it
                  hands the environment to its workers.

Run ``python -m tests.hdfscluster`` to provision and start one by hand: it prints the URI and
the environment to export, and stops the cluster on Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import venv
from pathlib import Path

import pytest

HOST = "127.0.0.1"
HADOOP_VERSION = "2.7.3"
JARS_SDIST = ("pyspark", "2.4.8")  # deps/jars: Hadoop 2.7.3 and its dependencies
LIBHDFS_SDIST = ("pydoop", "2.0.0")  # src/libhdfs: libhdfs's C sources
# The jars the NameNode, the DataNode and a libhdfs client load (by name, without ".jar").
# javax.ws.rs-api is not a Hadoop dependency in Hadoop's own distribution, but pyspark's copy
# of jersey expects it: without it the NameNode's web server fails to start.
_HADOOP = ("annotations", "auth", "common", "hdfs", "client")
JARS = tuple(f"hadoop-{name}-{HADOOP_VERSION}" for name in _HADOOP) + (
    "activation-1.1.1", "apacheds-i18n-2.0.0-M15", "apacheds-kerberos-codec-2.0.0-M15",
    "api-asn1-api-1.0.0-M20", "api-util-1.0.0-M20", "avro-1.8.2", "commons-beanutils-1.9.4",
    "commons-cli-1.2", "commons-codec-1.10", "commons-collections-3.2.2",
    "commons-compress-1.20", "commons-configuration-1.6", "commons-digester-1.8",
    "commons-httpclient-3.1", "commons-io-2.4", "commons-lang-2.6", "commons-lang3-3.5",
    "commons-logging-1.1.3", "commons-net-3.1", "curator-client-2.7.1",
    "curator-framework-2.7.1", "curator-recipes-2.7.1", "gson-2.2.4", "guava-14.0.1",
    "htrace-core-3.1.0-incubating", "httpclient-4.5.6", "httpcore-4.4.10",
    "jackson-core-asl-1.9.13", "jackson-mapper-asl-1.9.13", "javax.servlet-api-3.1.0",
    "javax.ws.rs-api-2.0.1", "jaxb-api-2.2.2", "jetty-6.1.26", "jetty-util-6.1.26",
    "jsp-api-2.1", "jsr305-1.3.9", "leveldbjni-all-1.8", "log4j-1.2.17", "netty-3.9.9.Final",
    "netty-all-4.1.47.Final", "paranamer-2.8", "protobuf-java-2.5.0", "slf4j-api-1.7.16",
    "slf4j-log4j12-1.7.16", "snappy-java-1.1.8.2", "stax-api-1.0-2", "xercesImpl-2.9.1",
    "xmlenc-0.52", "xz-1.5", "zookeeper-3.4.6",
)
# libhdfs's sources for POSIX, relative to src/libhdfs.
LIBHDFS_SOURCES = ("hdfs.c", "jni_helper.c", "exception.c", "common/htable.c",
                   "os/posix/mutexes.c", "os/posix/thread.c",
                   "os/posix/thread_local_storage.c")
# Each JVM: a small heap and the quick-start compiler; these are test daemons, not a cluster.
# -XX:-UsePerfData: no /tmp/hsperfdata_<user>/<pid> file, which a JVM killed with SIGKILL (a
# Ray worker holding a libhdfs client, at ray.shutdown) leaves behind.
SERVER_JAVA_OPTS = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                    "-XX:-UsePerfData", "-Djava.net.preferIPv4Stack=true")
CLIENT_JAVA_OPTS = "-Xmx128m -XX:+UseSerialGC -XX:-UsePerfData -Djava.net.preferIPv4Stack=true"
# The DataNode logs this once its blocks are known to the NameNode: the cluster can serve.
BLOCK_REPORT_LINE = "Successfully sent block report"
DEFAULT_START_TIMEOUT_S = 120.0
_LIBJVM_DIRS = ("lib/server", "jre/lib/server", "jre/lib/amd64/server", "lib/amd64/server")


def cache_dir() -> Path:
    """Where the fetched jars, C sources and built libhdfs.so are kept between runs."""
    default = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "raying-hdfs"
    return Path(os.environ.get("RAYING_HDFS_CACHE", default)).expanduser()


# --- what the machine must have -------------------------------------------------------------


def find_jdk() -> Path | None:
    """A JDK with jni.h and libjvm: JAVA_HOME if it is one, else the one ``java`` on PATH is in."""
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]))
    java = shutil.which("java")
    if java:
        candidates.append(Path(os.path.realpath(java)).parent.parent)
    for home in candidates:
        if (home / "include" / "jni.h").is_file() and _libjvm_dir(home) is not None:
            return home
    return None


def _libjvm_dir(java_home: Path) -> Path | None:
    for d in _LIBJVM_DIRS:
        if (java_home / d / "libjvm.so").is_file():
            return java_home / d
    return None


def missing() -> str | None:
    """Why a live HDFS cannot run here (a sentence), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the live HDFS fixture runs on Linux only (this is {sys.platform})"
    jdk = find_jdk()
    if jdk is None:
        return ("no JDK found (JAVA_HOME, or the java on PATH, with include/jni.h and "
                "lib/server/libjvm.so); install one, e.g. apt-get install openjdk-17-jdk-headless")
    if shutil.which("gcc") is None and not Install(cache_dir(), jdk).ready:
        return "no gcc found to build libhdfs.so; install one, e.g. apt-get install gcc"
    return None


# --- provisioning (cached) ------------------------------------------------------------------


class Install:
    """The cached pieces: Hadoop's jars, a webapps folder, libhdfs.so built for one JDK."""

    def __init__(self, root: Path, java_home: Path) -> None:
        self.root = root
        self.java_home = java_home
        self.lib = root / f"hadoop-{HADOOP_VERSION}" / "lib"
        self.resources = root / f"hadoop-{HADOOP_VERSION}" / "resources"
        self.libhdfs_src = root / "libhdfs-src"
        tag = hashlib.sha256(str(java_home.resolve()).encode()).hexdigest()[:12]
        self.native = root / f"native-{tag}"

    @property
    def jars(self) -> list[Path]:
        return [self.lib / f"{name}.jar" for name in JARS]

    def classpath(self, conf_dir: Path) -> str:
        """conf first (the XML settings), then the webapps folder, then every jar by name."""
        return os.pathsep.join([str(conf_dir), str(self.resources), *map(str, self.jars)])

    @property
    def ready(self) -> bool:
        return all(j.is_file() for j in self.jars) and (self.native / "libhdfs.so").is_file()


def provision(root: Path | None = None, java_home: Path | None = None,
              log=print) -> Install:
    """Fetch, unpack and build what a cluster and its client need, once per machine and JDK.

    Safe to run from several processes at once (a file lock); a half-done run is redone.

    Raises:
        RuntimeError: a step failed (the message carries pip's or gcc's output).
    """
    root = root or cache_dir()
    java_home = java_home or find_jdk()
    if java_home is None:
        raise RuntimeError(missing() or "no JDK found")
    root.mkdir(parents=True, exist_ok=True)
    install = Install(root, java_home)
    if install.ready:
        return install
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(j.is_file() for j in install.jars) or not install.libhdfs_src.is_dir():
            _fetch_and_unpack(install, log)
        if not (install.native / "libhdfs.so").is_file():
            _build_libhdfs(install, log)
    return install


def _fetch_and_unpack(install: Install, log) -> None:
    root = install.root
    work = Path(tempfile.mkdtemp(prefix="fetch-", dir=root))
    try:
        t0 = time.monotonic()
        tools = work / "tools"
        venv.create(tools, with_pip=True)
        tool_py = tools / "bin" / "python"
        _run([tool_py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
              "setuptools<70", "wheel"], "pip install setuptools<70 (for the sdists' setup.py)")
        specs = [f"{name}=={version}" for name, version in (JARS_SDIST, LIBHDFS_SDIST)]
        log(f"raying-hdfs: downloading {', '.join(specs)} from PyPI (once; ~220 MB)")
        _run([tool_py, "-m", "pip", "download", "-q", "--disable-pip-version-check",
              "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "-d",
              str(work / "dl"), *specs], "pip download")
        t1 = time.monotonic()
        jars_tgz = work / "dl" / "{}-{}.tar.gz".format(*JARS_SDIST)
        libhdfs_tgz = work / "dl" / "{}-{}.tar.gz".format(*LIBHDFS_SDIST)
        lib = work / "lib"
        lib.mkdir()
        wanted = {f"{JARS_SDIST[0]}-{JARS_SDIST[1]}/deps/jars/{n}.jar" for n in JARS}
        with tarfile.open(jars_tgz, "r:gz") as tar:
            for member in tar:
                if member.name in wanted and member.isfile():
                    (lib / Path(member.name).name).write_bytes(tar.extractfile(member).read())
        got = {p.stem for p in lib.glob("*.jar")}
        if got != set(JARS):
            msg = f"{jars_tgz.name} lacks jars: {sorted(set(JARS) - got)}"
            raise RuntimeError(msg)
        src = work / "libhdfs-src"
        prefix = f"{LIBHDFS_SDIST[0]}-{LIBHDFS_SDIST[1]}/src/libhdfs/"
        with tarfile.open(libhdfs_tgz, "r:gz") as tar:
            for member in tar:
                if member.name.startswith(prefix) and member.isfile():
                    out = src / member.name[len(prefix):]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(member).read())
        # Hadoop's HTTP servers look up webapps/<name> on the classpath; an empty web.xml is
        # enough for the NameNode and the DataNode to start them.
        resources = work / "resources"
        for name in ("hdfs", "datanode", "secondary"):
            web_inf = resources / "webapps" / name / "WEB-INF"
            web_inf.mkdir(parents=True)
            (web_inf / "web.xml").write_text(
                '<web-app version="2.5" xmlns="http://java.sun.com/xml/ns/javaee"/>\n')
        hadoop = root / f"hadoop-{HADOOP_VERSION}"
        shutil.rmtree(hadoop, ignore_errors=True)
        hadoop.mkdir()
        lib.rename(install.lib)
        resources.rename(install.resources)
        shutil.rmtree(install.libhdfs_src, ignore_errors=True)
        src.rename(install.libhdfs_src)
        log(f"raying-hdfs: fetched in {t1 - t0:.1f} s, unpacked {len(JARS)} jars in "
            f"{time.monotonic() - t1:.1f} s into {root}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build_libhdfs(install: Install, log) -> None:
    src, jdk = install.libhdfs_src, install.java_home
    libjvm = _libjvm_dir(jdk)
    tmp = Path(tempfile.mkdtemp(prefix="native-", dir=install.root))
    try:
        out = tmp / "libhdfs.so"
        includes = [jdk / "include", jdk / "include" / "linux", src, src / "include",
                    src / "os" / "posix", src / "os"]
        # -w: the 2018 sources warn a lot under current gcc; the rpath finds libjvm at run time.
        _run(["gcc", "-O2", "-fPIC", "-shared", "-w", "-o", str(out),
              *(f"-I{d}" for d in includes), *(str(src / f) for f in LIBHDFS_SOURCES),
              f"-L{libjvm}", "-ljvm", "-lpthread", f"-Wl,-rpath,{libjvm}"], "gcc libhdfs.so")
        shutil.rmtree(install.native, ignore_errors=True)
        tmp.rename(install.native)
        log(f"raying-hdfs: built {install.native / 'libhdfs.so'} against {jdk}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd, what: str) -> None:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        msg = f"{what} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
        raise RuntimeError(msg)


# --- the cluster ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _xml(settings: dict[str, object]) -> str:
    rows = "".join(f"  <property><name>{k}</name><value>{v}</value></property>\n"
                   for k, v in settings.items())
    return f'<?xml version="1.0"?>\n<configuration>\n{rows}</configuration>\n'


class HDFSCluster:
    """One NameNode and one DataNode on 127.0.0.1 (see the module docstring).

    Args:
        install: the provisioned pieces (:func:`provision`).
        run_dir: the cluster's folder (configuration, metadata, blocks, logs).
    """

    def __init__(self, install: Install, run_dir: str | os.PathLike) -> None:
        self.install = install
        self.dir = Path(run_dir)
        self.conf = self.dir / "conf"
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        # Fixed DataNode ports, so a restarted DataNode is where the NameNode last saw it.
        self.datanode_ports = {"address": free_port(), "ipc.address": free_port(),
                               "http.address": free_port()}
        self.namenode: subprocess.Popen | None = None
        self.datanode: subprocess.Popen | None = None
        self.classpath = install.classpath(self.conf)
        self._write_config()
        # Should the test process end without the fixture's teardown (an interrupted run).
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        """``hdfs://127.0.0.1:PORT``; append an absolute path for a dataset URI."""
        return f"hdfs://{HOST}:{self.port}"

    def uri(self, path: str) -> str:
        return f"{self.url}/{path.lstrip('/')}"

    @property
    def client_env(self) -> dict[str, str]:
        """What pyarrow's HadoopFileSystem needs in the environment to reach this cluster."""
        return {"JAVA_HOME": str(self.install.java_home),
                "ARROW_LIBHDFS_DIR": str(self.install.native),
                "CLASSPATH": self.classpath,
                "LIBHDFS_OPTS": CLIENT_JAVA_OPTS}

    def _write_config(self) -> None:
        data = self.dir / "data"
        self.conf.mkdir(parents=True, exist_ok=True)
        (self.conf / "core-site.xml").write_text(_xml({
            "fs.defaultFS": self.url,
            "hadoop.tmp.dir": data / "tmp",
            # A client retries a refused NameNode connection a few times, quickly.
            "ipc.client.connect.max.retries": 3,
            "ipc.client.connect.retry.interval": 200,
        }))
        dn = self.datanode_ports
        (self.conf / "hdfs-site.xml").write_text(_xml({
            "dfs.namenode.name.dir": (data / "name").as_uri(),
            "dfs.datanode.data.dir": (data / "blocks").as_uri(),
            "dfs.namenode.rpc-address": f"{HOST}:{self.port}",
            "dfs.namenode.http-address": f"{HOST}:0",
            "dfs.namenode.secondary.http-address": f"{HOST}:0",
            "dfs.datanode.address": f"{HOST}:{dn['address']}",
            "dfs.datanode.ipc.address": f"{HOST}:{dn['ipc.address']}",
            "dfs.datanode.http.address": f"{HOST}:{dn['http.address']}",
            "dfs.replication": 1,
            "dfs.webhdfs.enabled": "false",
            # On, as on a real cluster: the tests' own user started the NameNode, so it is
            # HDFS's superuser; other users (hdfs://alice@...) meet the permissions.
            "dfs.permissions.enabled": "true",
            "dfs.namenode.datanode.registration.ip-hostname-check": "false",
            "dfs.namenode.safemode.extension": 0,
            "dfs.heartbeat.interval": 1,
            # Client side: after a failed block read, wait ~50 ms (not 3 s) before asking the
            # NameNode again, so an unreachable DataNode fails a read within a second.
            "dfs.client.retry.window.base": 50,
        }))
        (self.conf / "log4j.properties").write_text(
            "log4j.rootLogger=WARN,out\n"
            "log4j.appender.out=org.apache.log4j.ConsoleAppender\n"
            # stderr: a libhdfs client's warnings must not mix into a program's output.
            "log4j.appender.out.Target=System.err\n"
            "log4j.appender.out.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.out.layout.ConversionPattern=%d %p %c{1}: %m%n\n"
            # INFO for the DataNode: its block-report line tells start() the cluster is up.
            "log4j.logger.org.apache.hadoop.hdfs.server.datanode.DataNode=INFO\n")

    def _java(self, main: str, *args: str) -> list[str]:
        # The daemons' web servers unpack into java.io.tmpdir (a Jetty_* folder per start,
        # never removed): the cluster's own folder, removed with it.
        return [str(self.install.java_home / "bin" / "java"), *SERVER_JAVA_OPTS,
                f"-Djava.io.tmpdir={self.tmp}",
                f"-Dhadoop.log.dir={self.dir / 'logs'}", "-cp", self.classpath,
                f"org.apache.hadoop.hdfs.server.{main}", *args]

    def _spawn(self, main: str, log_name: str) -> subprocess.Popen:
        log = open(self.dir / log_name, "ab")  # noqa: SIM115 - the child owns it
        cmd = self._java(main)
        # A test process that dies hard (a crash, SIGKILL) runs neither the fixture's
        # teardown nor atexit: the daemon gets SIGTERM from the kernel instead. Linux sends
        # it when the *thread* that started the child ends, so only from the main thread (a
        # DataNode restarted from a short-lived thread is stopped by the fixture as before).
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
        try:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Format the NameNode (first start only), start both daemons, wait until they serve."""
        if not (self.dir / "data" / "name").exists():
            fmt = subprocess.run(self._java("namenode.NameNode", "-format", "-nonInteractive",
                                            "-force"),
                                 capture_output=True, text=True, timeout=timeout_s, check=False)
            if fmt.returncode != 0:
                msg = f"NameNode -format failed:\n{(fmt.stdout + fmt.stderr)[-3000:]}"
                raise RuntimeError(msg)
        if self.namenode is None or self.namenode.poll() is not None:
            self.namenode = self._spawn("namenode.NameNode", "namenode.log")
        self.start_datanode(timeout_s)

    def start_datanode(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Start the DataNode; return once it has sent its block report to the NameNode."""
        if self.datanode is not None and self.datanode.poll() is None:
            return
        reports = self._block_reports()
        self.datanode = self._spawn("datanode.DataNode", "datanode.log")
        deadline = time.monotonic() + timeout_s
        while self._block_reports() <= reports:
            for name, proc in (("NameNode", self.namenode), ("DataNode", self.datanode)):
                if proc.poll() is not None:
                    self.stop()
                    msg = (f"the {name} exited ({proc.returncode}) while starting; see "
                           f"{self.dir}/{name.lower()}.log")
                    raise RuntimeError(msg)
            if time.monotonic() > deadline:
                self.stop()
                msg = f"HDFS did not come up in {timeout_s:.0f} s; see the logs in {self.dir}"
                raise RuntimeError(msg)
            time.sleep(0.1)

    def put(self, local: str | os.PathLike, path: str, timeout_s: float = 120.0) -> str:
        """Copy a local folder's files to ``path`` (emptied first) through pyarrow and
        libhdfs in a Python process of its own; its ``hdfs://`` URI.

        Test data goes in this way rather than through libhdfs in the test process: the test
        process's JVM is kept for the reads under test, and a client fault while writing
        (the write pipeline right after a DataNode restart, say) fails this copy, which is
        retried once, instead of ending the process that runs every test. Hadoop's own shell
        would do the same but writes one file at a time, each close waiting ~0.25 s for the
        NameNode, where pyarrow copies on several threads.
        """
        uri = self.uri(path)
        script = (
            "import sys, pyarrow.fs as f\n"
            "fs = f.HadoopFileSystem(sys.argv[1], int(sys.argv[2]))\n"
            "fs.delete_dir_contents(sys.argv[4], missing_dir_ok=True)\n"
            "f.copy_files(sys.argv[3], sys.argv[4], source_filesystem=f.LocalFileSystem(), "
            "destination_filesystem=fs)\n")
        env = {**os.environ, **self.client_env}
        argv = [sys.executable, "-c", script, HOST, str(self.port), str(local),
                "/" + path.lstrip("/")]
        for attempt in (1, 2):
            done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
            if done.returncode == 0:
                return uri
            if attempt == 2:
                msg = (f"copying {local} to {uri} failed ({done.returncode}):\n"
                       f"{done.stderr[-3000:]}")
                raise RuntimeError(msg)
            time.sleep(1.0)
        return uri

    def shell(self, *args: str, timeout_s: float = 120.0) -> str:
        """Run Hadoop's shell (``hdfs dfs``) against this cluster as its superuser, e.g.
        ``shell("-chmod", "700", "/secret")``; its output."""
        cmd = [str(self.install.java_home / "bin" / "java"), *CLIENT_JAVA_OPTS.split(),
               "-cp", self.classpath, "org.apache.hadoop.fs.FsShell", "-fs", self.url, *args]
        done = subprocess.run(cmd, env={**os.environ, **self.client_env}, capture_output=True,
                              text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            msg = f"hdfs dfs {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
            raise RuntimeError(msg)
        return done.stdout

    def _block_reports(self) -> int:
        path = self.dir / "datanode.log"
        return path.read_text(errors="replace").count(BLOCK_REPORT_LINE) if path.exists() else 0

    def stop_datanode(self) -> None:
        """Stop the DataNode (SIGTERM, then SIGKILL after 10 s); its blocks stay on disk."""
        _stop(self.datanode)
        self.datanode = None

    def stop(self) -> None:
        """Stop both daemons, by PID."""
        self.stop_datanode()
        _stop(self.namenode)
        self.namenode = None

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each running daemon (Linux /proc)."""
        out = {}
        for name, proc in (("namenode", self.namenode), ("datanode", self.datanode)):
            if proc is not None and proc.poll() is None:
                text = Path(f"/proc/{proc.pid}/status").read_text()
                out[name] = int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024
        return out


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_cluster(run_dir: str | os.PathLike, log=print):
    """Provision (cached), start a cluster in ``run_dir``, stop it on the way out."""
    cluster = HDFSCluster(provision(log=log), run_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hdfs_cluster(tmp_path_factory):
    """The session's HDFS cluster; skips with the reason where no JDK or gcc is found."""
    reason = missing()
    if reason:
        if os.environ.get("RAYING_TEST_HDFS") == "require":  # CI: never skip silently
            pytest.fail(f"RAYING_TEST_HDFS=require, but {reason}")
        print(f"\nlive HDFS tests skipped: {reason}", file=sys.stderr)
        pytest.skip(reason)
    with running_cluster(tmp_path_factory.mktemp("hdfs"),
                         log=lambda m: print(m, file=sys.stderr)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def hdfs(hdfs_cluster):
    """The cluster, with its client environment set for the module (before its Ray starts)."""
    from raying.storage import files

    with pytest.MonkeyPatch.context() as mp:
        for name, value in hdfs_cluster.client_env.items():
            mp.setenv(name, value)
        files.clear_cache()
        yield hdfs_cluster
    files.clear_cache()


if __name__ == "__main__":
    if missing():
        sys.exit(missing())
    run_dir = tempfile.mkdtemp(prefix="raying-hdfs-")
    with running_cluster(run_dir) as c:
        for k, v in c.client_env.items():
            print(f"export {k}='{v}'")
        print(f"# HDFS at {c.url} (folder {c.dir}); Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    shutil.rmtree(run_dir, ignore_errors=True)
