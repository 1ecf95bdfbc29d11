"""The drafter registry: versions on disk, their metadata (in Redis or beside the folders), aliases
(champion, canary, pinned), promotion and rollback."""
