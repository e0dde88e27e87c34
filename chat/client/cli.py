"""``python -m chat.client``: the command line (one-shot, interactive, ``load``) over the session library."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager

from . import commands
from .load import print_summary, run_load
from .session import (DEFAULT_URL, EXIT_CODES, EXIT_CONNECT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK,
                      EXIT_TIMEOUT, Answer, ChatTimeout, ClientError, ServerError, Session, collect, ws_url)


class _Interrupts:
    """SIGINT while an answer streams: the first press requests a cancel, the second quits."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def _handler(self, signum: int, frame: object) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()

    @contextmanager
    def armed(self):
        """Install the handler for the duration of one answer."""
        self.event.clear()
        if threading.current_thread() is not threading.main_thread():
            yield self.event
            return
        previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield self.event
        finally:
            signal.signal(signal.SIGINT, previous)


def _params(args: argparse.Namespace) -> dict:
    """The ``params`` object from the command-line flags (only those given)."""
    params = {}
    if args.temperature is not None:
        params["temperature"] = args.temperature
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.max_tokens is not None:
        params["max_new_tokens"] = args.max_tokens
    if args.seed is not None:
        params["seed"] = args.seed
    if args.thinking is not None:
        params["enable_thinking"] = args.thinking == "on"
    return params


def _check_params(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject out-of-range values before connecting (the server would say bad_message)."""
    if args.temperature is not None and not 0 <= args.temperature <= 2:
        parser.error("--temperature must be between 0 and 2")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.client_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{16,64}", args.client_id):
        parser.error("--client-id must be 16-64 characters of A-Za-z0-9_-")
    try:
        ws_url(args.url)
    except ValueError as exc:
        parser.error(f"--url: {exc}")


def _common(parser: argparse.ArgumentParser) -> None:
    """Connection and sampling flags shared by chat and load."""
    parser.add_argument("--url", default=os.environ.get("CHAT_URL", DEFAULT_URL),
                        help="server WebSocket URL (default: $CHAT_URL or %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("CHAT_API_KEY") or None,
                        help="sent as 'Authorization: Bearer KEY' (default: $CHAT_API_KEY)")
    parser.add_argument("--client-id", default=os.environ.get("CHAT_CLIENT_ID") or None,
                        help="identity cookie to present (16-64 chars of A-Za-z0-9_-); reuse it to "
                             "reach earlier conversations (default: $CHAT_CLIENT_ID, else random)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for the connection and for each server message "
                             "(default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print the raw protocol frames the server sends, one JSON object a line")
    parser.add_argument("--system", help="system prompt (for a new conversation)")
    parser.add_argument("--temperature", type=float, help="sampling temperature, 0-2 (0: greedy)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling, (0, 1]")
    parser.add_argument("--max-tokens", type=int, help="most new tokens in the answer")
    parser.add_argument("--seed", type=int, help="sampling seed, for repeatable answers")
    parser.add_argument("--thinking", choices=("on", "off"),
                        help="a thinking model thinks before answering (on) or not (off); default: the model's own")
    parser.add_argument("--hide-thinking", action="store_true",
                        help="print only the answer, not a thinking model's thinking")


def build_parser() -> argparse.ArgumentParser:
    """The parser for chatting (one-shot or interactive)."""
    parser = argparse.ArgumentParser(
        prog="python -m chat.client",
        description="Chat with the server over its WebSocket. With a prompt (or piped stdin) "
                    "print the answer as it streams; with no prompt on a terminal, chat "
                    "interactively (/new: new conversation, /edit, /continue, /search, /open, "
                    "/help, /quit; Ctrl-C stops an "
                    "answer, a second Ctrl-C quits). 'python -m chat.client load --help' "
                    "describes the load generator.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="*", help="the question ('-': read it from stdin)")
    parser.add_argument("-i", "--interactive", action="store_true",
                        help="multi-turn chat, even when stdin is not a terminal")
    parser.add_argument("--conversation", metavar="ID",
                        help="continue this conversation (it must belong to --client-id)")
    _common(parser)
    return parser


def build_load_parser() -> argparse.ArgumentParser:
    """The parser for ``load``."""
    parser = argparse.ArgumentParser(
        prog="python -m chat.client load",
        description="Run chats concurrently (one thread and one socket per stream) and report "
                    "time to first delta, tokens/s and errors.",
        epilog=EXIT_CODES.replace("the answer arrived (done reason stop or length)",
                                  "every request succeeded")
                          .replace("the server sent an error frame, or done with reason error/shutdown",
                                   "some request failed (see errors)"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", "-c", type=int, default=8, help="parallel streams (default: %(default)s)")
    parser.add_argument("--requests", "-n", type=int, default=32, help="chats in all (default: %(default)s)")
    parser.add_argument("--prompt", default="Write a short story about a robot who learns to paint.",
                        help="the question each chat asks")
    _common(parser)
    return parser


class _Printer:
    """Writes answers (or raw frames with --json) to stdout, flushing every piece. A thinking model's thinking
    comes first, set apart: dimmed between "Thinking…" and "…done thinking" on a terminal; on stderr when
    stdout is not one (so a pipe gets only the answer); not at all with --hide-thinking."""

    def __init__(self, raw: bool, hide_thinking: bool = False) -> None:
        self.raw = raw
        self.hide_thinking = hide_thinking
        self.at_line_start = True
        self.thinking = False  # inside a thinking block now
        self.tty = sys.stdout.isatty()

    def thought(self, text: str) -> None:
        if self.raw or self.hide_thinking or not text:
            return
        if not self.tty:
            if not self.thinking:
                sys.stderr.write("Thinking…\n")
            self.thinking = True
            sys.stderr.write(text)
            sys.stderr.flush()
            return
        if not self.thinking:
            _write(("" if self.at_line_start else "\n") + "\033[2mThinking…\n")
            self.thinking = True
        _write(text)

    def _end_thinking(self) -> None:
        if self.thinking:
            self.thinking = False
            if self.tty:
                _write("\n…done thinking.\033[0m\n\n")
            else:
                sys.stderr.write("\n…done thinking.\n")
                sys.stderr.flush()
            self.at_line_start = True

    def frame(self, direction: str, text: str) -> None:
        if self.raw and direction == "<":
            _write(text + "\n")

    def text(self, text: str) -> None:
        if not self.raw and text:
            self._end_thinking()
            _write(text)
            self.at_line_start = text.endswith("\n")

    def end(self) -> None:
        self._end_thinking()
        if not self.raw and not self.at_line_start:
            _write("\n")
        self.at_line_start = True


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _say(message: str) -> None:
    """One line for the user on stderr."""
    print(f"chat.client: {message}", file=sys.stderr, flush=True)


def _stream(session: Session, printer: _Printer, interrupts: _Interrupts, request: str | dict,
            **kwargs) -> tuple[dict | None, dict | None, bool]:
    """Print one answer as it streams; returns (start, done, whether the user cancelled).
    ``request`` is a prompt (a chat, with ``kwargs``) or a whole request frame."""
    if isinstance(request, str):
        request = {"type": "chat", "content": request, **kwargs}
    with interrupts.armed() as cancel:
        answer = Answer()
        try:
            answer = collect(session.request(request, cancel), on_delta=printer.text, on_thought=printer.thought)
        except ChatTimeout:
            if not cancel.is_set():
                raise
        finally:
            printer.end()
        return answer.start, answer.done, cancel.is_set()


def _exit_for(done: dict | None, cancelled: bool) -> int:
    """Map how an answer ended to the exit status."""
    reason = (done or {}).get("reason")
    if cancelled:
        return EXIT_INTERRUPTED
    if reason in ("stop", "length"):
        return EXIT_OK
    if reason == "timeout":
        _say("the answer was cut short by the server's generation time limit")
        return EXIT_TIMEOUT
    _say(f"the answer ended with reason {reason!r}")
    return EXIT_ERROR


def _one_shot(session: Session, printer: _Printer, args: argparse.Namespace, prompt: str) -> int:
    """Ask one question, stream the answer, exit."""
    interrupts = _Interrupts()
    try:
        session.connect()
        _, done, cancelled = _stream(session, printer, interrupts, prompt,
                                     conversation_id=args.conversation,
                                     system=None if args.conversation else args.system,
                                     params=_params(args))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        session.close()
    return _exit_for(done, cancelled)


def _interactive(session: Session, printer: _Printer, args: argparse.Namespace, first: str | None) -> int:
    """A multi-turn chat at a ``> `` prompt."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    try:
        ready = session.connect()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if sys.stdin.isatty():
        _say(f"connected to {ready.get('model', '?')}; /new starts a new conversation, /help lists "
             "commands, /quit quits, Ctrl-C stops an answer")
    interrupts = _Interrupts()
    slash = commands.Commands(session, _say)
    conversation = args.conversation
    system = None if conversation else args.system
    try:
        while True:
            if first is not None:
                line, first = first, None
            else:
                try:
                    if printer.raw:  # keep stdout pure JSON
                        sys.stderr.write("> ")
                        sys.stderr.flush()
                    line = input("" if printer.raw else "> ")
                except EOFError:
                    printer.end()
                    return EXIT_OK
            line = line.strip()
            if not line:
                continue
            if line in ("/quit", "/exit", "/q"):
                return EXIT_OK
            if line == "/new":
                conversation = None
                system = args.system
                _say("new conversation")
                continue
            if line == "/help":
                _say(commands.HELP)
                continue
            try:
                request = slash.request_for(line, conversation)
                if request is None:
                    continue
                if isinstance(request, commands.Open):
                    conversation, system = request.conversation_id, None
                    continue
                if session.ws is None:
                    session.connect()
                request.setdefault("conversation_id", conversation)
                if request["type"] == "chat":
                    request["system"] = system
                request["params"] = _params(args)
                start, done, cancelled = _stream(session, printer, interrupts, request)
            except ServerError as exc:
                _say(str(exc))
                if exc.code == "not_found" and conversation:
                    _say("that conversation is not this client's (see --client-id)")
                continue
            except ClientError as exc:
                _say(str(exc))
                continue
            if start and start.get("conversation_id"):
                conversation = start["conversation_id"]
                system = None  # the system prompt belongs to the conversation now
            if cancelled:
                _say("cancelled (Ctrl-C again to quit)")
            elif done and done.get("reason") not in ("stop", "length"):
                _say(f"the answer ended with reason {done.get('reason')!r}")
    except KeyboardInterrupt:
        printer.end()
        return EXIT_OK
    finally:
        session.close()


def _load_main(argv: list[str]) -> int:
    """``python -m chat.client load ...``."""
    parser = build_load_parser()
    args = parser.parse_args(argv)
    _check_params(parser, args)
    if args.concurrency < 1 or args.requests < 1:
        parser.error("--concurrency and --requests must be at least 1")
    try:
        summary = run_load(args.url, concurrency=args.concurrency, requests=args.requests,
                           prompt=args.prompt, params=_params(args), system=args.system,
                           timeout=args.timeout, api_key=args.api_key)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print_summary(summary)
    if summary["ok"] == summary["requests"]:
        return EXIT_OK
    if summary["errors"].get("connect") == summary["requests"]:
        _say(f"cannot connect to {ws_url(args.url)}")
        return EXIT_CONNECT
    return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["load"]:
            return _load_main(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        _check_params(parser, args)
        prompt = " ".join(args.prompt).strip() or None
        if args.prompt == ["-"] or (prompt is None and not args.interactive and not sys.stdin.isatty()):
            prompt = sys.stdin.read().strip()
            if not prompt:
                parser.error("the prompt read from stdin is empty")
        printer = _Printer(args.json, args.hide_thinking)
        session = Session(args.url, api_key=args.api_key, client_id=args.client_id,
                          timeout=args.timeout, on_frame=printer.frame)
        if args.interactive or prompt is None:
            return _interactive(session, printer, args, prompt)
        return _one_shot(session, printer, args, prompt)
    except ClientError as exc:
        _say(str(exc))
        return exc.exit_code
    except BrokenPipeError:
        # stdout went away (e.g. `| head`): stop quietly, without a second error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
