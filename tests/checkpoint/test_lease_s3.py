"""The lease on S3 while its heartbeat thread rewrites it: this process's own checks of the lease
(every commit makes one, from the background save thread) never see it half-replaced."""

from __future__ import annotations

from harness.checkpoint import CheckpointStore
from s3server import options


def test_lease_checks_while_the_heartbeat_rewrites_it(s3_server, s3_url):
    # On S3 a read is a HEAD, then a GET conditional on the HEAD's ETag (s3fs): a rewrite between
    # the two fails the read with 412 "pre-conditions did not hold" unless reads and writes of
    # this process take turns. A heartbeat every 10 ms makes the overlap frequent.
    store = CheckpointStore(s3_url, storage_options=options(s3_server.endpoint), lease_heartbeat_s=0.01)
    with store.lease():
        for _ in range(150):
            store._lease.check()
            store._lease.poll()  # the heartbeat thread's own failure, if it had one
