"""A c10d Store on an etcd cluster: the job's coordination store, surviving the loss of any node.

    chameleon-launch --store etcd://host1:2379,host2:2379,host3:2379/myjob ...

The agents' TCPStore lives in the node-0 agent: when node 0 is lost, every survivor loses the
store (c10d "Connection reset by peer") and the job dies. An etcd cluster of 2f+1 members keeps
serving while f of them are lost, so with its members on different machines (or off the training
nodes) no single node takes the job with it.

Which API. etcd's v3 API, through the JSON gateway every etcd server has at ``/v3/...`` (HTTP
POST, base64 keys and values), with the standard library's http.client:

- not v2 (torch's ``torch.distributed.elastic.rendezvous.etcd_store.EtcdStore`` over python-etcd):
  v2 is off by default since etcd 3.4 and removed in 3.6, and it has no multi-key transactions;
- v3 transactions give what membership needs in one request each: ``compare_set`` (compare the
  value or the key's absence, put), exactly-once ``add`` and ``append`` (compare the key's
  mod_revision, put; see below), ``multi_get`` and ``check`` as one read-only transaction, and
  blocking ``get``/``wait`` as a watch from the revision at which the key was seen missing (no
  polling, no missed update);
- the gateway needs no client library: python-etcd3 (gRPC; last release 0.12.0) fails to import
  with protobuf 4 and later ("Descriptors cannot be created directly", its issues #1957, #2709),
  etcd3gw brings requests and its own dependency tree; a few JSON endpoints need neither.

The store is a Python subclass of ``dist.Store``: c10d calls its methods for the rendezvous of
process groups (``init_process_group(store=PrefixStore(f"gen{g}", store))``, ``new_group``). In
torch 2.13 gloo's rendezvous uses set, get and wait(keys, timeout) (measured with a recording
store); membership and the launcher use set, get, check, compare_set, append, multi_get, add, wait
and clone. Every key lives below the job's namespace (the URL's path, default ``default``), so
several jobs can share a cluster; a job needs a namespace of its own (an old job's keys would be
read as this job's).

Failover: the client talks to one endpoint at a time; a request that fails at the transport
(refused, reset, no answer within ``request_timeout_s``) or that the member answers with
"unavailable" (no leader, leader changed: gRPC codes 14 and 4) is sent again to the next endpoint,
round robin, until ``unavailable_s`` has passed. A retried put or compare_set is idempotent;
``add`` and ``append`` are read-modify-write, so each attempt also writes an operation key
(``{namespace}.op/{client}/{n}``) in the same transaction, and a retry first looks for it: a
request whose answer was lost is never applied twice.

Timeouts (each bounds one thing):
- ``request_timeout_s`` (2 s): one HTTP request to one member, connect to answer (and one slice
  of a watch). A healthy cluster answers in milliseconds (etcd warns past 100 ms). When the leader
  dies, a follower may have forwarded our write to it: the proposal is lost and the follower
  answers only when its own (longer) request timeout expires, so this bound is what a leader's
  loss costs (about 2 s measured, against 5 s with a 5 s bound). A request cut short on a slow but healthy member
  is merely sent again to the next one (every retry is safe, see above).
- ``unavailable_s`` (30 s): one operation's retries across the members when none answers: several
  leader elections (etcd's default election timeout is 1 s) and a member restart fit in it; after
  it the cluster counts as lost and EtcdUnavailable (a RuntimeError, like a broken TCPStore
  connection) is raised.
- the store's c10d ``timeout`` (``set_timeout``; 300 s by default, the constructor's ``timeout``):
  how long a blocking ``get``, ``wait`` or ``multi_get`` waits for an absent key (c10d's
  semantics), then DistStoreError naming the keys. Gloo passes its group's timeout to ``wait``.

Keys are never deleted by the store itself; run etcd with ``--auto-compaction-retention`` so that
the history of frequently written keys (heartbeats) does not fill its quota (docs/launching.md).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

# gRPC status codes that mean "this member cannot serve now, another may": UNAVAILABLE (no
# leader, leader changed, member stopping) and DEADLINE_EXCEEDED (a proposal timed out).
_RETRY_CODES = {4, 14}
# etcd's default --max-txn-ops is 128; reads of more keys are split into transactions of this many.
_TXN_KEYS = 64
# c10d holds a Python store by its C++ part only (pybind11 keeps no reference to the Python
# object): once the Python object is collected, a process group built on it fails ("Not
# implemented") at its next rendezvous (new_group). Every instance is therefore kept for the life
# of the process; a process makes a handful (connect_store, clone).
_LIVE: list["EtcdStore"] = []


class EtcdUnavailable(RuntimeError):
    """No member of the etcd cluster answered within the store's unavailable_s."""


class EtcdRequestError(RuntimeError):
    """etcd refused a request (not a transient error): the message names it."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _raw(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def _value(kv: dict) -> bytes:
    return base64.b64decode(kv.get("value", ""))


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key starting with `prefix` (etcd's range_end for a prefix)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class _Transport(Exception):
    """A member did not answer (or answered "unavailable"): try the next one."""


class EtcdStore(dist.Store):
    """A c10d Store over etcd's v3 JSON gateway (see the module docstring).

    `endpoints` are the cluster's client addresses (host, port); `namespace` names this job's key
    space. Construction checks that a member answers (retrying for `connect_timeout_s`); raises
    EtcdUnavailable otherwise. One instance is safe to use from several threads (one request at a
    time); ``clone()`` gives another connection, for a thread that must not wait behind others.
    """

    def __init__(self, endpoints: list[tuple[str, int]], namespace: str = "default", *,
                 timeout: timedelta = timedelta(seconds=300), request_timeout_s: float = 2.0,
                 unavailable_s: float = 30.0, connect_timeout_s: float | None = None):
        super().__init__()
        if not endpoints:
            raise ValueError("an etcd store needs at least one endpoint")
        self.endpoints = [(str(h), int(p)) for h, p in endpoints]
        self.namespace = namespace.strip("/") or "default"
        self.request_timeout_s = float(request_timeout_s)
        self.unavailable_s = float(unavailable_s)
        self.set_timeout(timeout)
        self._prefix = (self.namespace + "/").encode()
        self._client = f"{self.namespace}.op/{uuid.uuid4().hex[:16]}/".encode()
        self._ops = 0
        self._current = 0                      # index of the endpoint in use
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.RLock()
        self._call("/v3/kv/range", {"key": _b64(self._prefix), "count_only": True},
                   self.unavailable_s if connect_timeout_s is None else connect_timeout_s)
        _LIVE.append(self)

    def __repr__(self) -> str:
        return f"EtcdStore({self.url})"

    @property
    def url(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"etcd://{hosts}/{self.namespace}"

    def clone(self) -> "EtcdStore":
        """A new client of the same store (its own connection), starting at the endpoint in use."""
        return EtcdStore(self.endpoints[self._current:] + self.endpoints[:self._current],
                         self.namespace, timeout=self.timeout,
                         request_timeout_s=self.request_timeout_s,
                         unavailable_s=self.unavailable_s)

    # ------------------------------------------------------------------ transport

    def _post(self, path: str, body: dict, timeout_s: float) -> dict:
        """One request to the current endpoint; _Transport when it cannot answer now."""
        host, port = self.endpoints[self._current]
        if self._conn is None:
            self._conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        self._conn.timeout = timeout_s
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout_s)
        try:
            self._conn.request("POST", path, body=json.dumps(body),
                               headers={"Content-Type": "application/json"})
            resp = self._conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            raise _Transport(f"{host}:{port}: {e or type(e).__name__}") from None
        try:
            out = json.loads(data) if data else {}
        except ValueError:
            self._drop()
            raise _Transport(f"{host}:{port}: HTTP {resp.status}, not JSON") from None
        if resp.status == 200 and "error" not in out:
            return out
        code, msg = out.get("code"), out.get("message") or out.get("error") or f"HTTP {resp.status}"
        if code in _RETRY_CODES or resp.status >= 500 and code is None:
            self._drop()
            raise _Transport(f"{host}:{port}: {msg}")
        raise EtcdRequestError(f"etcd at {host}:{port} refused {path}: {msg}")

    def _drop(self) -> None:
        """Forget the connection and move to the next endpoint."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._current = (self._current + 1) % len(self.endpoints)

    def _call(self, path: str, body: dict, within_s: float | None = None) -> dict:
        """`body` to `path`, failing over across the endpoints for up to `within_s`
        (default unavailable_s)."""
        window = self.unavailable_s if within_s is None else within_s
        deadline = time.monotonic() + window
        pause, errors = 0.02, []
        with self._lock:
            while True:
                for _ in self.endpoints:
                    left = deadline - time.monotonic()
                    try:
                        return self._post(path, body, max(0.05, min(self.request_timeout_s, left)))
                    except _Transport as e:
                        errors = [*errors[1 - len(self.endpoints):], str(e)]
                    if time.monotonic() >= deadline:
                        raise EtcdUnavailable(f"no etcd member answered within {window:g} s "
                                              f"({'; '.join(errors)})")
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, 0.5)

    # ------------------------------------------------------------------ key helpers

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _raw(key)

    def _read(self, keys: list[str | bytes]) -> tuple[list[dict | None], int]:
        """The key-values of `keys` (None where absent) as of one revision per transaction of
        _TXN_KEYS keys, and the revision of the last one."""
        out: list[dict | None] = []
        revision = 0
        for i in range(0, len(keys), _TXN_KEYS):
            chunk = keys[i:i + _TXN_KEYS]
            if len(chunk) == 1:
                r = self._call("/v3/kv/range", {"key": _b64(self._key(chunk[0]))})
                answers = [r]
            else:
                r = self._call("/v3/kv/txn", {"success": [
                    {"request_range": {"key": _b64(self._key(k))}} for k in chunk]})
                answers = [x.get("response_range", {}) for x in r.get("responses", [])]
            revision = int(r["header"]["revision"])
            out.extend((a.get("kvs") or [None])[0] for a in answers)
        return out, revision

    # ------------------------------------------------------------------ the c10d Store API

    def set(self, key: str, value: str | bytes) -> None:
        self._call("/v3/kv/put", {"key": _b64(self._key(key)), "value": _b64(_raw(value))})

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting for it up to the store's timeout."""
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of `keys`, waiting for them up to the store's timeout."""
        return [_value(kv) for kv in self._read_present(list(keys), self.timeout)]

    def check(self, keys: list[str]) -> bool:
        kvs, _ = self._read(list(keys))
        return all(kv is not None for kv in kvs)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key exists; DistStoreError after `timeout` (default: the store's)."""
        self._read_present(list(keys), timeout or self.timeout)

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """TCPStore's compare_set: set `key` to `desired_value` if its value is `expected_value`
        (an empty `expected_value` also matches an absent key); returns the value it then holds
        (for an absent key and a non-empty `expected_value`, that `expected_value`)."""
        k, expected, desired = self._key(key), _raw(expected_value), _raw(desired_value)
        compares = [{"key": _b64(k), "target": "VERSION", "result": "EQUAL", "version": "0"}]
        if expected:
            compares = [{"key": _b64(k), "target": "VALUE", "result": "EQUAL",
                         "value": _b64(expected)}]
        for _ in range(2):
            r = self._call("/v3/kv/txn", {
                "compare": compares,
                "success": [{"request_put": {"key": _b64(k), "value": _b64(desired)}}],
                "failure": [{"request_range": {"key": _b64(k)}}]})
            if r.get("succeeded"):
                return desired
            kvs = r["responses"][0]["response_range"].get("kvs")
            if not kvs:
                return expected
            current = _value(kvs[0])
            if current or expected:
                return current
            # present and empty, expected empty: TCPStore sets it; compare the value instead
            compares = [{"key": _b64(k), "target": "VALUE", "result": "EQUAL", "value": ""}]
        return current

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the integer at `key` (0 if absent); returns the new value."""
        if amount == 0:
            kvs, _ = self._read([key])
            if kvs[0] is not None:
                return int(_value(kvs[0]))
        return int(self._update(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: str | bytes) -> None:
        """Append `value` to the bytes at `key` (created if absent)."""
        tail = _raw(value)
        self._update(key, lambda old: (old or b"") + tail)

    def delete_key(self, key: str) -> bool:
        r = self._call("/v3/kv/deleterange", {"key": _b64(self._key(key))})
        return int(r.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        r = self._call("/v3/kv/range", {"key": _b64(self._prefix),
                                        "range_end": _b64(_prefix_end(self._prefix)),
                                        "count_only": True})
        return int(r.get("count", 0))

    # ------------------------------------------------------------------ internals

    def _update(self, key: str, fn) -> bytes:
        """Replace `key`'s value v (None if absent) by fn(v), exactly once, and return it.

        Each attempt is one transaction: if the key is still at the revision we read, put the new
        value and this operation's key; else read both. Finding the operation key means an earlier
        attempt (whose answer was lost to a failover) was applied: its result is returned."""
        k = _b64(self._key(key))
        with self._lock:
            self._ops += 1
            op = _b64(self._client + str(self._ops).encode())
        old: bytes | None = None
        mod = "0"
        while True:
            new = fn(old)
            r = self._call("/v3/kv/txn", {
                "compare": [{"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": mod},
                            {"key": op, "target": "VERSION", "result": "EQUAL", "version": "0"}],
                "success": [{"request_put": {"key": k, "value": _b64(new)}},
                            {"request_put": {"key": op, "value": _b64(new)}}],
                "failure": [{"request_range": {"key": k}}, {"request_range": {"key": op}}]})
            if r.get("succeeded"):
                return new
            current, done = (x["response_range"].get("kvs") for x in r["responses"])
            if done:
                return _value(done[0])
            old = _value(current[0]) if current else None
            mod = current[0]["mod_revision"] if current else "0"

    def _read_present(self, keys: list[str], timeout: timedelta) -> list[dict]:
        """The key-values of `keys` once all exist; DistStoreError naming them after `timeout`."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            kvs, revision = self._read(keys)
            missing = [k for k, kv in zip(keys, kvs) if kv is None]
            if not missing:
                return kvs
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(
                    f"etcd store {self.url}: timed out after {timeout.total_seconds():g} s "
                    f"waiting for keys {missing}")
            self._watch(missing[0], revision, left)

    def _watch(self, key: str, revision: int, left_s: float) -> None:
        """Block until `key` is put after `revision` (it was absent then), for at most `left_s`,
        or until the watch ends early (the caller reads again)."""
        # A watch on a member that went silent would never end: watch for at most
        # request_timeout_s, then read again (which fails over if the member is gone).
        host, port = self.endpoints[self._current]
        limit = min(left_s, self.request_timeout_s)
        started = time.monotonic()
        conn = http.client.HTTPConnection(host, port, timeout=limit)
        try:
            conn.request("POST", "/v3/watch", body=json.dumps({"create_request": {
                "key": _b64(self._key(key)), "start_revision": str(revision + 1)}}),
                headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            while resp.status == 200:
                line = resp.readline()
                if not line:
                    break
                result = json.loads(line).get("result", {})
                if result.get("events"):
                    return
                if result.get("canceled"):      # compacted past `revision`: read again
                    return
        except socket.timeout:
            return
        except (OSError, http.client.HTTPException, ValueError):
            pass
        finally:
            conn.close()
        # The member refused or dropped the watch: do not spin on it.
        time.sleep(max(0.0, min(0.05, limit - (time.monotonic() - started))))
