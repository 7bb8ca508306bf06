"""HDFS URIs, and the checks of what libhdfs needs (Java, libhdfs.so, Hadoop jars)."""

from __future__ import annotations

import contextlib
import ctypes.util
import faulthandler
import glob
import io
import os
import sys
from collections.abc import Mapping
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from raying.errors import ConfigError, DependencyError, StorageError

DEFAULT_HDFS_PORT = 8020
# pyarrow's host for "the namenode of fs.defaultFS in core-site.xml", and the port it wants then.
DEFAULT_FS_HOST = "default"
DEFAULT_FS_PORT = 0

FIX_CLASSPATH = "export CLASSPATH=$($HADOOP_HOME/bin/hadoop classpath --glob)"
_LIBHDFS = "libhdfs.dylib" if sys.platform == "darwin" else "libhdfs.so"
_LIBJVM = "libjvm.dylib" if sys.platform == "darwin" else "libjvm.so"
# Where JDKs keep libjvm, relative to JAVA_HOME (JDK 9+, JDK 8, and per-architecture layouts).
_LIBJVM_DIRS = ("lib/server", "jre/lib/server", "jre/lib/amd64/server", "lib/amd64/server",
                "jre/lib/aarch64/server", "lib/aarch64/server", "lib")


def parse_hdfs_uri(uri: str) -> tuple[str, int, str, str | None]:
    """Split an HDFS URI.

    ``hdfs://host:port/path`` names a namenode (port 8020 when left out); ``hdfs:///path`` uses
    ``fs.defaultFS`` of the Hadoop configuration (host ``"default"``, port 0), which is also the
    form for an HA nameservice. A user may be given as ``hdfs://user@host/path``.

    Returns:
        ``(host, port, path, user)``; ``path`` is absolute, ``user`` None when not in the URI.

    Raises:
        ConfigError: the URI is not ``hdfs://`` or its port is not a number in 1..65535.
    """
    parts = urlsplit(uri)
    if parts.scheme != "hdfs":
        msg = f"expected an hdfs:// URI, got {uri!r}"
        raise ConfigError(msg)
    if parts.query or parts.fragment:
        msg = f"HDFS URI {uri!r} has a query or fragment; pass settings through storage= instead"
        raise ConfigError(msg)
    path = parts.path or "/"
    user = parts.username
    if not parts.hostname:
        return DEFAULT_FS_HOST, DEFAULT_FS_PORT, path, user
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is None:
        port = DEFAULT_HDFS_PORT
    if not 0 < port < 65536:
        msg = (f"HDFS URI {uri!r} has an invalid port; expected hdfs://host:port/path with a "
               f"port in 1..65535 (the namenode's, usually {DEFAULT_HDFS_PORT})")
        raise ConfigError(msg)
    return parts.hostname, port, path, user


def check_hdfs_environment(env: Mapping[str, str] | None = None) -> None:
    """Check what pyarrow's libhdfs needs before it is loaded, one requirement at a time.

    Args:
        env: the environment to check; ``os.environ`` by default.

    Raises:
        DependencyError: naming the first missing piece (JAVA_HOME, libjvm, libhdfs or the
            Hadoop jars on CLASSPATH) and how to provide it.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    _check_java(environ.get("JAVA_HOME"))
    _check_libhdfs(environ)
    _check_classpath(environ.get("CLASSPATH"))


def _check_java(java_home: str | None) -> None:
    if not java_home:
        msg = ("HDFS needs Java, but JAVA_HOME is not set; install a JDK (8 or later) and "
               "export JAVA_HOME=/path/to/jdk (the directory holding bin/java)")
        raise DependencyError(msg)
    if not os.path.isdir(java_home):
        msg = (f"HDFS needs Java, but JAVA_HOME={java_home!r} is not a directory; "
               "export JAVA_HOME=/path/to/jdk (the directory holding bin/java)")
        raise DependencyError(msg)
    if any(os.path.isfile(os.path.join(java_home, d, _LIBJVM)) for d in _LIBJVM_DIRS):
        return
    # Other CPU architectures' folders (lib/ppc64le/server, ...), at their fixed depth: a
    # recursive search from a JAVA_HOME such as /usr (what `dirname $(dirname $(which
    # java))` gives on Debian) never ends in symlink loops (/usr/bin/X11 -> .), and a
    # libjvm found anywhere below is not one that libhdfs loads.
    if any(glob.glob(os.path.join(java_home, *parts, _LIBJVM))
           for parts in (("lib", "*", "server"), ("jre", "lib", "*", "server"))):
        return
    msg = (f"HDFS needs Java, but JAVA_HOME={java_home!r} holds no {_LIBJVM} in "
           f"{', '.join(_LIBJVM_DIRS[:4])} (where libhdfs looks); point JAVA_HOME at a full "
           f"JDK, the folder above its bin/java: $(dirname $(dirname $(readlink -f $(which "
           f"java))))")
    raise DependencyError(msg)


def _check_libhdfs(env: Mapping[str, str]) -> None:
    places = []
    arrow_dir = env.get("ARROW_LIBHDFS_DIR")
    hadoop_home = env.get("HADOOP_HOME")
    if arrow_dir:
        places.append(arrow_dir)
    if hadoop_home:
        places.append(os.path.join(hadoop_home, "lib", "native"))
    places += [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    if any(os.path.isfile(os.path.join(d, _LIBHDFS)) for d in places):
        return
    if ctypes.util.find_library("hdfs"):
        return
    looked = [f"ARROW_LIBHDFS_DIR ({arrow_dir or 'not set'})",
              f"HADOOP_HOME/lib/native ({hadoop_home or 'HADOOP_HOME not set'})",
              "LD_LIBRARY_PATH and the system library path"]
    msg = (f"HDFS needs {_LIBHDFS}, which was not found in {'; '.join(looked)}. Install Hadoop "
           "and export HADOOP_HOME=/path/to/hadoop, or export ARROW_LIBHDFS_DIR=/directory/"
           f"holding/{_LIBHDFS}")
    raise DependencyError(msg)


def _check_classpath(classpath: str | None) -> None:
    if not classpath:
        msg = f"HDFS needs the Hadoop jars on CLASSPATH, which is not set; fix: {FIX_CLASSPATH}"
        raise DependencyError(msg)
    entries = [e for e in classpath.split(os.pathsep) if e]
    jars = [e for e in entries if e.endswith(".jar") and "hadoop" in os.path.basename(e)]
    if jars:
        return
    if any(e.endswith("*") for e in entries):
        msg = ("HDFS needs the Hadoop jars on CLASSPATH, which holds wildcard entries (dir/*) "
               f"that libhdfs does not expand; fix: {FIX_CLASSPATH}")
        raise DependencyError(msg)
    msg = (f"HDFS needs the Hadoop jars on CLASSPATH, which holds none (no hadoop-*.jar among "
           f"{len(entries)} entries); fix: {FIX_CLASSPATH}")
    raise DependencyError(msg)


def keep_python_interrupts() -> None:
    """Start libhdfs's JVM with ``-Xrs`` (added to ``LIBHDFS_OPTS`` unless there): without it
    the JVM takes SIGINT, SIGTERM and SIGHUP for itself and ends the process on them (exit
    130 at Ctrl-C, no ``KeyboardInterrupt``, no ``finally``, no ``pipe.close()``; now and then
    a segmentation fault, its shutdown racing Python threads inside JNI calls). With it they
    stay Python's; the JVM keeps the signals it needs (SIGSEGV and the others of its own
    use). Read once, when the process's JVM starts."""
    opts = os.environ.get("LIBHDFS_OPTS", "")
    if "-Xrs" not in opts.split():
        os.environ["LIBHDFS_OPTS"] = f"{opts} -Xrs".strip()


def keep_jvm_signal_handlers() -> None:
    """Keep a later ``ray.init`` in this process from displacing the JVM's signal handlers.

    libhdfs runs a JVM inside the process, and the JVM takes SIGSEGV by design (safepoint
    polls, implicit null checks in compiled code), relying on its own handler to resume. A
    handler installed over the JVM's turns the next such fault into the end of the process
    ("Fatal Python error: Segmentation fault") at a random moment of some later HDFS call.
    ``ray.init`` installs two: Ray's C++ failure handler, and Python's faulthandler when it is
    not on yet. The usual order, scanning an ``hdfs://`` dataset and then building the
    pipeline (which starts Ray), would put both over the JVM's; a JVM started after
    ``ray.init`` chains to them and is safe. So, before the JVM starts: faulthandler is turned
    on now (the JVM then passes it the faults that are not its own, and Ray leaves it be),
    and Ray's switch ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read when Ray is imported, is
    set in the environment (for an import still to come, and the processes Ray starts) and
    in Ray's constants if they are loaded. Ray then prints no C++ stack trace on a crash in
    this process; the JVM's and Python's crash reports remain.
    """
    if not faulthandler.is_enabled():
        with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
            faulthandler.enable()  # as ray.init would; stderr may have no descriptor
    os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def hdfs_filesystem(host: str, port: int, user: str | None) -> pafs.HadoopFileSystem:
    """Check the environment, then connect pyarrow's HadoopFileSystem.

    Raises:
        DependencyError: Java, libhdfs or the Hadoop jars are missing (see
            :func:`check_hdfs_environment`).
        StorageError: the namenode could not be reached or libhdfs failed to load.
    """
    check_hdfs_environment()
    keep_jvm_signal_handlers()
    keep_python_interrupts()
    try:
        return pafs.HadoopFileSystem(host, port, user=user)
    except (OSError, RuntimeError) as exc:
        where = "fs.defaultFS" if host == DEFAULT_FS_HOST else f"{host}:{port}"
        msg = (f"cannot connect to HDFS at {where}: {exc}. Check the namenode address "
               "(hdfs://host:port/path; hdfs:///path takes fs.defaultFS from the "
               "core-site.xml that libhdfs finds on CLASSPATH) and that libhdfs, JAVA_HOME and "
               "CLASSPATH match one Hadoop install")
        err = StorageError(msg)
        err.outage = True
        raise err from None
