"""Load-aware connection hand-off: the supervisor accepts, the least-loaded worker serves.

SO_REUSEPORT hashes connections blind to load, and long-lived HTTP/2 connections keep an uneven split for their whole
lives. The design (load count, passing over and taking back from a stalled worker, waits when every socket is full) is
in docs/proxy/workers.md.

The messages both ends speak and the shared close counts: ``protocol``; a worker's end: ``inbox``; the supervisor's
accepting thread: ``dispatcher``."""
