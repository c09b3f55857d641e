"""The driver: a validated JobSpec in, a trained (or resumed) run and its summary out.

It connects to Ray (a cluster, the warm local head, or a new local Ray),
builds the backend's Ray Train trainer, follows the run through the events
Ray Train's controller forwards, shows progress, and writes the run log. It
also runs unmodified scripts on the workers and submits runs as Ray jobs.
"""
