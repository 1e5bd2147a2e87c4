"""async_rl/signals.py: the one way each role turns SIGTERM / SIGINT into its stop event."""

import os
import signal
import threading

from async_rl.signals import stop_on_signals


def test_a_signal_sets_the_stop_event_names_itself_and_the_old_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    event = threading.Event()
    with stop_on_signals(event) as request:
        assert request.event is event and not event.is_set()
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread before kill returns here
        assert event.wait(5) and request.signal_name == "SIGTERM"
    assert {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} == before


def test_off_the_main_thread_no_handler_is_installed_and_the_event_still_stops_the_role():
    seen = {}

    def role() -> None:
        with stop_on_signals() as request:
            seen["handler"] = signal.getsignal(signal.SIGTERM)
            request.event.set()
            seen["set"] = request.event.is_set()

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=role)
    thread.start()
    thread.join(5)
    assert seen == {"handler": before, "set": True}
