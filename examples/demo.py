"""Every demo agent, for the worker `make run` starts (`--import examples.demo`)."""

from examples import flight_agent, flight_booking, outreach, refunds, research  # noqa: F401
