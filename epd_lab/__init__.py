"""Tooling for running the middleware inside real vLLM on this machine: the tiny model, the server
launcher, and the CPU demo. Not part of the installed package; the e2e tests and the demo use it."""
