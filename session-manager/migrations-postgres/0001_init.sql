-- ongrid-manager schema, version 1. Never edit a migration once released: add a new file.
-- PostgreSQL: every file here is the port of the file of the same name in ../migrations (SQLite),
-- with the same tables and columns. Text is TEXT COLLATE "C" so that it sorts byte-wise as in
-- SQLite (times as text sort as time), integers are BIGINT, reals DOUBLE PRECISION.
-- Times are RFC 3339 UTC text with nanoseconds (fixed width, so text order is time order).

-- A user is a certificate subject DN with the login name and UID the manager gave it.
CREATE TABLE users (
    dn          TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    user_name   TEXT COLLATE "C" NOT NULL UNIQUE,
    uid         BIGINT NOT NULL UNIQUE,
    created_at  TEXT COLLATE "C" NOT NULL
);

-- A node whose agent registered.
CREATE TABLE nodes (
    name           TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    gpu_backend    TEXT COLLATE "C" NOT NULL,
    agent_version  TEXT COLLATE "C" NOT NULL,
    registered_at  TEXT COLLATE "C" NOT NULL,
    last_seen      TEXT COLLATE "C" NOT NULL
);

-- A GPU as its node last reported it (info: GpuInfo as JSON) and the admin's mode for it
-- ("exclusive" or "shared:N").
CREATE TABLE gpus (
    uuid        TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    node        TEXT COLLATE "C" NOT NULL REFERENCES nodes(name),
    info        TEXT COLLATE "C" NOT NULL,
    mode        TEXT COLLATE "C" NOT NULL,
    updated_at  TEXT COLLATE "C" NOT NULL
);
CREATE INDEX gpus_node ON gpus(node);

-- A session. request: GpuRequest as JSON; gpus: assigned GpuIds as a JSON array; reason: the
-- reason of the last transition (the history is in session_transitions).
CREATE TABLE sessions (
    id              TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    name            TEXT COLLATE "C" NOT NULL,
    owner           TEXT COLLATE "C" NOT NULL REFERENCES users(dn),
    request         TEXT COLLATE "C" NOT NULL,
    image           TEXT COLLATE "C" NOT NULL,
    state           TEXT COLLATE "C" NOT NULL,
    reason          TEXT COLLATE "C" NOT NULL,
    node            TEXT COLLATE "C" REFERENCES nodes(name),
    gpus            TEXT COLLATE "C" NOT NULL DEFAULT '[]',
    created_at      TEXT COLLATE "C" NOT NULL,
    queued_at       TEXT COLLATE "C" NOT NULL,
    preferred_node  TEXT COLLATE "C"
);
-- A name is unique among one owner's sessions that have not ended.
CREATE UNIQUE INDEX sessions_live_name ON sessions(owner, name) WHERE state <> 'ENDED';
CREATE INDEX sessions_state ON sessions(state, queued_at, id);
CREATE INDEX sessions_node ON sessions(node);

-- Every change of a session's state; seq 0 is the creation (from_state NULL).
CREATE TABLE session_transitions (
    session_id  TEXT COLLATE "C" NOT NULL REFERENCES sessions(id),
    seq         BIGINT NOT NULL,
    from_state  TEXT COLLATE "C",
    to_state    TEXT COLLATE "C" NOT NULL,
    at          TEXT COLLATE "C" NOT NULL,
    reason      TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (session_id, seq)
);
