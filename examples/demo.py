"""Every demo agent, for the worker `make run` starts (`--import examples.demo`), and the
README's (examples/trips.py), so that its commands work in a second terminal."""

from examples import flight_agent, flight_booking, outreach, refunds, research, trips  # noqa: F401
