"""An OpenEnv environment server as an env, unchanged: ``agentgym/OpenEnv-v0``
(``env=openenv``).

OpenEnv (``openenv-core``) serves an environment over HTTP and a WebSocket: ``reset``,
``step`` and ``state`` on the typed ``Action`` / ``Observation`` models its author wrote.
This env speaks that protocol as ``openenv-core``'s own ``EnvClient`` does: one WebSocket
session (``/ws``) per episode, ``{"type": "reset", "data": {"seed": s}}`` then
``{"type": "step", "data": ACTION}`` messages, each answered by
``{"type": "observation", "data": {"observation", "reward", "done"}}``. So the server side
needs nothing of AgentGym, and this side nothing of ``openenv-core`` (the WebSocket
client is ``websockets``: ``pip install -e '.[openenv]'`` in the checkout).

    agentgym train env=openenv openenv.url=http://127.0.0.1:8000 openenv.action_field=message
    agentgym train env=openenv openenv.app=my_env.server.app:app openenv.action_field=message

* **The server**: ``openenv.url`` reaches one that runs; ``openenv.app`` (``module:app``,
  as ``uvicorn`` takes it) is served by a process this run starts on a loopback port and
  supervises (:class:`agentgym.supervision.supervisor.Supervisor`, as the retriever): a server
  that dies or stops answering ``GET /health`` is restarted, and the episodes it failed are
  infrastructure failures, replayed or dropped, never trained on.
* **Observations become messages**: the first (``reset``'s) is the user turn after
  ``openenv.system``; each later one a ``user`` message through the chat template. A
  message is ``openenv.observation_field`` of the observation when set, else the
  observation's fields as JSON.
* **Actions are parsed from the policy's tokens**: with ``openenv.action_field`` set the
  reply (its last ``<action>…</action>`` if it writes one) is that field's text; without,
  the reply must hold the action as a JSON object (the last ``{…}`` in it). An action the
  server refuses (its model's validation) is a malformed action: the policy sees the
  server's message and tries again.
* **Rewards and done flags flow through**: each step's ``reward`` is the turn's reward
  (``None``: 0), ``done`` ends the episode (``terminated``); ``rollout.max_turns`` truncates.
* **Rows** are reset seeds: ``data=train`` holds seeds ``0 .. openenv.size - 1``, the
  held-out ``data=test`` ``openenv.eval_seed ..``; a GRPO group's samples share their
  row's seed, so they play the same task when the server seeds its ``reset``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from dataclasses import dataclass

from agentgym.envs.base import AgentEnv
from agentgym.envs.manifest import EnvManifest
from agentgym.tools.errors import MissingExtra

logger = logging.getLogger(__name__)

INSTALL = "pip install -e '.[openenv]' in the checkout (the websockets package)"
_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)
PLACEHOLDER = "(the first observation of the OpenEnv server's reset)"
#: the server of ``env=openenv`` without ``openenv.url`` or ``openenv.app``: a guessing game
#: written with openenv-core's own helpers
DEFAULT_APP = "agentgym.tools.openenv_guess:app"


@dataclass
class OpenEnvConfig:
    """``openenv.*``: which server, and how its actions and observations are text."""

    url: str = ""  # a running OpenEnv server, http://host:port (its WebSocket is /ws)
    app: str = ""  # or module:app, served by uvicorn in a process the run starts and supervises
    action_field: str = ""  # the action's text field the reply fills ("": the reply holds JSON)
    observation_field: str = ""  # the field shown ("": the only field's text, else JSON)
    system: str = ""  # a system message before the first observation ("" = none)
    timeout_s: float = 60.0  # one reset or step
    max_restarts: int = 5  # openenv.app: restarts of the served process
    size: int = 1000  # data=train: rows for reset seeds 0 .. size - 1
    eval_size: int = 100  # data=test: rows for seeds eval_seed .. eval_seed + eval_size - 1
    eval_seed: int = 1_000_000

    def __post_init__(self) -> None:
        if self.url and self.app:
            raise ValueError(f"openenv.url={self.url!r} and openenv.app={self.app!r}: give one "
                             f"(a running server, or the app this run serves)")
        if self.app and ":" not in self.app:
            raise ValueError(f"openenv.app={self.app!r}: give module:attribute, as uvicorn "
                             f"takes it (my_env.server.app:app)")
        if self.timeout_s <= 0:
            raise ValueError(f"openenv.timeout_s must be > 0, got {self.timeout_s}")
        for name in ("size", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"openenv.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_seed < self.size:
            raise ValueError(f"openenv.eval_seed={self.eval_seed} is a training seed (0 .. "
                             f"{self.size - 1}); give one >= {self.size}")


# -- the served app ---------------------------------------------------------------------
_SERVED: dict[tuple[str, int], "ServedApp"] = {}
_SERVED_LOCK = threading.Lock()


class ServedApp:
    """``uvicorn module:app`` on a free loopback port, supervised: restarted on the same
    port when it dies or stops answering ``GET /health``."""

    def __init__(self, app: str, max_restarts: int = 5, startup_timeout: float = 120.0) -> None:
        self.app, self.max_restarts, self.startup_timeout = app, max_restarts, startup_timeout
        self.url: str | None = None
        self.server = self.supervisor = None

    def start(self) -> str:
        if self.server is not None:
            return self.url
        import os

        # lazy: loads httpx
        from agentgym.supervision.server_process import ServerProcess, free_port
        from agentgym.supervision.supervisor import Supervisor  # lazy: loads httpx
        port = free_port()
        cmd = [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "info"]
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        self.server = ServerProcess(cmd, f"http://127.0.0.1:{port}", name=f"OpenEnv {self.app}",
                                    startup_timeout=self.startup_timeout,
                                    env={"PYTHONPATH": path})
        self.url = self.server.start()
        self.supervisor = Supervisor(self.server, max_restarts=self.max_restarts)
        logger.info("serving OpenEnv app %s at %s", self.app, self.url)
        return self.url

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.url = None


def served_url(app: str, max_restarts: int = 5) -> str:
    """The URL of this process's server for ``app``, started on first use, stopped at exit.
    The built-in app needs ``openenv-core``: without it, :class:`MissingExtra`."""
    import atexit
    import importlib.util
    if app == DEFAULT_APP and importlib.util.find_spec("openenv") is None:
        raise MissingExtra("env=openenv without openenv.url or openenv.app serves its example "
                           "server, written with openenv-core: pip install --no-deps "
                           "openenv-core==0.3.0 fastmcp (docs/ECOSYSTEM.md)")
    with _SERVED_LOCK:
        key = (app, max_restarts)
        if key not in _SERVED:
            _SERVED[key] = ServedApp(app, max_restarts)
            atexit.register(_SERVED[key].stop)
        return _SERVED[key].start()


def stop_served() -> None:
    """Stop every app :func:`served_url` started in this process."""
    with _SERVED_LOCK:
        apps = list(_SERVED.values())
        _SERVED.clear()
    for app in apps:
        app.stop()


# -- the env -----------------------------------------------------------------------------
class ServerGone(RuntimeError):
    """The server closed the session, or did not answer in time: not the policy's doing."""


class OpenEnvEnv(AgentEnv, env_id="agentgym/OpenEnv-v0", short="openenv"):
    """An OpenEnv server's environment, one WebSocket session per episode.

    Args:
        url: the server's base URL (``http://host:port``).
        action_field: the action field the reply fills ("": the reply holds the action as
            a JSON object).
        observation_field: the observation field shown ("": the only field's text, else
            every field as JSON).
        system: a system message before the first observation ("" = none).
        timeout_s: one reset or step.
        max_turns: actions per episode.
    """

    observation_format = "chat"
    stop_strings = ("</action>",)

    def __init__(self, url: str = "", action_field: str = "", observation_field: str = "",
                 system: str = "", timeout_s: float = 60.0,
                 max_turns: int | None = None) -> None:
        super().__init__(max_turns=max_turns)
        import importlib.util
        if importlib.util.find_spec("websockets") is None:
            raise MissingExtra(f"env=openenv needs websockets: {INSTALL}")
        self.url = (url or served_url(DEFAULT_APP)).rstrip("/")
        self.action_field, self.observation_field = action_field, observation_field
        self.system, self.timeout_s = system, timeout_s
        self._ws, self._gone = None, ""

    # -- the session -------------------------------------------------------------------
    def _connect(self):
        from websockets.sync.client import connect
        ws_url = "ws" + self.url[len("http"):] + "/ws" if self.url.startswith("http") \
            else self.url + "/ws"
        # entered at once and closed by _close_session (websockets >= 17 wants the form)
        return connect(ws_url, open_timeout=self.timeout_s, max_size=100 * 2 ** 20).__enter__()

    def _close_session(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.send(json.dumps({"type": "close"}))
            except Exception:  # noqa: BLE001 - a session that is gone is closed
                pass
            try:
                ws.close()
            except Exception:  # noqa: BLE001
                pass

    def _call(self, kind: str, data: dict) -> dict:
        """One request of the session; the server's reply (an observation or an error).
        Raises :class:`ServerGone` when the connection fails or the reply is late."""
        from agentgym.supervision.supervisor import report_down, report_up  # lazy: loads httpx
        try:
            if self._ws is None:
                self._ws = self._connect()
            self._ws.send(json.dumps({"type": kind, "data": data}))
            reply = json.loads(self._ws.recv(timeout=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - OSError, TimeoutError, websockets' ConnectionClosed
            self._close_session()
            # its outage is counted, and a rollout replaying the episode waits for a
            # supervised server's restart (agentgym.supervision.supervisor)
            report_down(self.url, f"{type(e).__name__}: {e}")
            raise ServerGone(f"{type(e).__name__}: {e}") from e
        report_up(self.url)
        if reply.get("type") == "error" and (reply.get("data") or {}).get("code") in (
                "CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR"):
            self._close_session()
            raise ServerGone(f"{reply['data']['code']}: {reply['data'].get('message', '')}")
        return reply

    def _show(self, observation: dict) -> str:
        """The text of an observation: ``observation_field``'s value; without one, the
        only field's text, else every field as JSON."""
        if self.observation_field:
            value = observation.get(self.observation_field, "")
        elif len(observation) == 1 and isinstance(next(iter(observation.values())), str):
            value = next(iter(observation.values()))
        else:
            value = observation
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    # -- the episode -------------------------------------------------------------------
    def _reset(self, row):
        self._close_session()
        self._gone = ""
        seed = ((row or {}).get("extra_info") or {}).get("seed")
        if seed is None:
            seed = int(self.np_random.integers(1_000_000))
        system = [{"role": "system", "content": self.system}] if self.system else []
        try:
            reply = self._call("reset", {"seed": int(seed)})
            if reply.get("type") != "observation":
                raise ServerGone(f"reset answered {json.dumps(reply)[:300]}")
        except ServerGone as e:  # the episode ends at its first step, an infra failure
            self._gone = f"openenv reset: {e}"
            self.infra_failure(self._gone)
            return system + [{"role": "user", "content": f"The environment at {self.url} is "
                              f"unavailable."}], {"seed": int(seed)}
        observation = reply["data"].get("observation") or {}
        return system + [{"role": "user", "content": self._show(observation)}], \
            {"seed": int(seed)}

    def _action(self, text: str) -> dict | None:
        tagged = _ACTION.findall(text)
        body = (tagged[-1] if tagged else text).strip()
        if self.action_field:
            return {self.action_field: body}
        starts = [m.start() for m in re.finditer(r"\{", body)]
        for start in reversed(starts):  # the last JSON object in the reply
            try:
                value, _ = json.JSONDecoder().raw_decode(body[start:])
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
        return None

    def _step(self, action, last_turn):
        if self._gone:  # reset found no server: nothing to play
            self.count("tool_failures")
            return [], 0.0, True, {"server_error": self._gone[:300]}
        payload = self._action(action)
        if payload is None:
            self.count("malformed_actions")
            return [{"role": "user", "content": "Your reply holds no action: write it as a "
                     "JSON object."}], 0.0, False, {}
        try:
            reply = self._call("step", payload)
        except ServerGone as e:
            self.count("tool_failures")
            self.infra_failure(f"openenv step: {e}")
            self._close_session()
            return [], 0.0, True, {"server_error": str(e)[:300]}
        if reply.get("type") == "error":
            err = reply.get("data") or {}
            if err.get("code") == "VALIDATION_ERROR":
                self.count("malformed_actions")
            else:
                self.count("tool_failures")
            details = "; ".join(f"{'.'.join(map(str, x.get('loc', ())))}: {x.get('msg', '')}"
                                for x in err.get("errors") or [] if isinstance(x, dict))
            return [{"role": "user", "content": f"The environment refused the action "
                     f"({err.get('code', 'error')}): {err.get('message', '')}"
                     f"{' (' + details + ')' if details else ''}"}], 0.0, False, {}
        data = reply.get("data") or {}
        reward = data.get("reward")
        reward = float(reward) if isinstance(reward, (int, float)) else 0.0
        if data.get("done"):
            self._close_session()
            return [], reward, True, {}
        if last_turn:
            self._close_session()
        return [{"role": "user", "content": self._show(data.get("observation") or {})}], \
            reward, False, {}

    def close(self) -> None:
        self._close_session()
        super().close()


# -- what the trainer asks of it (envs.manifest) ------------------------------------------
def seed_rows(openenv: OpenEnvConfig, split: str = "train") -> list[dict]:
    """Rows of reset seeds (the server makes each task from its seed)."""
    first, count = (0, openenv.size) if split == "train" else (openenv.eval_seed,
                                                                openenv.eval_size)
    return [{"data_source": "openenv", "prompt": [{"role": "user", "content": PLACEHOLDER}],
             "reward_model": {"style": "env", "ground_truth": ""},
             "extra_info": {"seed": s, "index": s - first, "id": f"openenv-{split}-{s}"},
             "env": "openenv"} for s in range(first, first + count)]


def heldout_seed_rows(openenv: OpenEnvConfig) -> list[dict]:
    return seed_rows(openenv, "test")


def openenv_kwargs(openenv: OpenEnvConfig) -> dict:
    """The server's URL (the app served on first use) and the text protocol."""
    url = openenv.url or served_url(openenv.app or DEFAULT_APP, openenv.max_restarts)
    return {"url": url, "action_field": openenv.action_field,
            "observation_field": openenv.observation_field, "system": openenv.system,
            "timeout_s": openenv.timeout_s}


MANIFEST = EnvManifest(
    sections={"openenv": OpenEnvConfig},
    presets={"trainer.eval_data": "test"},
    datasets={"train": seed_rows, "test": heldout_seed_rows},
    kwargs=openenv_kwargs,
    sources=lambda openenv: {"url": openenv.url, "app": openenv.app},
)
