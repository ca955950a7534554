"""Multi-site deployment: provisioning (class allow lists, job storage), a loopback federation of separate
processes, FLARE API submission, the POC quick path. See README "Hospital IT"."""
