-- Owned GPUs and reservations (site policy, issue 12).
-- owner: the accounting group an admin gave the node (all its GPUs) or the GPU (wins over its
-- node's); NULL: nobody owns it.
ALTER TABLE nodes ADD COLUMN owner TEXT COLLATE "C";
ALTER TABLE gpus ADD COLUMN owner TEXT COLLATE "C";
-- GPUs kept for one group's work from starts_at until ends_at. gpus: a JSON array of GPU UUIDs;
-- empty when node names a whole node (its GPUs as registered at each moment).
CREATE TABLE reservations (
    name TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    accounting_group TEXT COLLATE "C" NOT NULL,
    node TEXT COLLATE "C",
    gpus TEXT COLLATE "C" NOT NULL,
    starts_at TEXT COLLATE "C" NOT NULL,
    ends_at TEXT COLLATE "C" NOT NULL,
    created_by TEXT COLLATE "C" NOT NULL,
    created_at TEXT COLLATE "C" NOT NULL
);
-- The reservation a session, or a job chain (by its first job's id), uses. Written before the
-- session or job, so no key references them; a removed reservation leaves its rows unused.
CREATE TABLE session_reservations (
    session_id TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    reservation TEXT COLLATE "C" NOT NULL
);
CREATE TABLE job_chain_reservations (
    chain_initial TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    reservation TEXT COLLATE "C" NOT NULL
);
