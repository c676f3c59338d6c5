"""Put on a lab PD's PYTHONPATH only (epd_lab.servers): every Python process of that server (API server,
engine core, workers) installs the V1-runner shim at start-up. See epd_lab/v1_runner_shim.py."""

from epd_lab.v1_runner_shim import install

install()
