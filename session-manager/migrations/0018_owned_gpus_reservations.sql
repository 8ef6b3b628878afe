-- Owned GPUs and reservations (site policy, issue 12).
-- owner: the accounting group an admin gave the node (all its GPUs) or the GPU (wins over its
-- node's); NULL: nobody owns it.
ALTER TABLE nodes ADD COLUMN owner TEXT;
ALTER TABLE gpus ADD COLUMN owner TEXT;
-- GPUs kept for one group's work from starts_at until ends_at. gpus: a JSON array of GPU UUIDs;
-- empty when node names a whole node (its GPUs as registered at each moment).
CREATE TABLE reservations (
    name TEXT PRIMARY KEY NOT NULL,
    accounting_group TEXT NOT NULL,
    node TEXT,
    gpus TEXT NOT NULL,
    starts_at TEXT NOT NULL,
    ends_at TEXT NOT NULL,
    created_by TEXT NOT NULL,
    created_at TEXT NOT NULL
);
-- The reservation a session, or a job chain (by its first job's id), uses. Written before the
-- session or job, so no key references them; a removed reservation leaves its rows unused.
CREATE TABLE session_reservations (
    session_id TEXT PRIMARY KEY NOT NULL,
    reservation TEXT NOT NULL
);
CREATE TABLE job_chain_reservations (
    chain_initial TEXT PRIMARY KEY NOT NULL,
    reservation TEXT NOT NULL
);
