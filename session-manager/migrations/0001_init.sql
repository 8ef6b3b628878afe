-- ongrid-manager schema, version 1. Never edit a migration once released: add a new file.
-- Times are RFC 3339 UTC text with nanoseconds (fixed width, so text order is time order).

-- A user is a certificate subject DN with the login name and UID the manager gave it.
CREATE TABLE users (
    dn          TEXT PRIMARY KEY NOT NULL,
    user_name   TEXT NOT NULL UNIQUE,
    uid         INTEGER NOT NULL UNIQUE,
    created_at  TEXT NOT NULL
) STRICT;

-- A node whose agent registered.
CREATE TABLE nodes (
    name           TEXT PRIMARY KEY NOT NULL,
    gpu_backend    TEXT NOT NULL,
    agent_version  TEXT NOT NULL,
    registered_at  TEXT NOT NULL,
    last_seen      TEXT NOT NULL
) STRICT;

-- A GPU as its node last reported it (info: GpuInfo as JSON) and the admin's mode for it
-- ("exclusive" or "shared:N").
CREATE TABLE gpus (
    uuid        TEXT PRIMARY KEY NOT NULL,
    node        TEXT NOT NULL REFERENCES nodes(name),
    info        TEXT NOT NULL,
    mode        TEXT NOT NULL,
    updated_at  TEXT NOT NULL
) STRICT;
CREATE INDEX gpus_node ON gpus(node);

-- A session. request: GpuRequest as JSON; gpus: assigned GpuIds as a JSON array; reason: the
-- reason of the last transition (the history is in session_transitions).
CREATE TABLE sessions (
    id              TEXT PRIMARY KEY NOT NULL,
    name            TEXT NOT NULL,
    owner           TEXT NOT NULL REFERENCES users(dn),
    request         TEXT NOT NULL,
    image           TEXT NOT NULL,
    state           TEXT NOT NULL,
    reason          TEXT NOT NULL,
    node            TEXT REFERENCES nodes(name),
    gpus            TEXT NOT NULL DEFAULT '[]',
    created_at      TEXT NOT NULL,
    queued_at       TEXT NOT NULL,
    preferred_node  TEXT
) STRICT;
-- A name is unique among one owner's sessions that have not ended.
CREATE UNIQUE INDEX sessions_live_name ON sessions(owner, name) WHERE state <> 'ENDED';
CREATE INDEX sessions_state ON sessions(state, queued_at, id);
CREATE INDEX sessions_node ON sessions(node);

-- Every change of a session's state; seq 0 is the creation (from_state NULL).
CREATE TABLE session_transitions (
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    seq         INTEGER NOT NULL,
    from_state  TEXT,
    to_state    TEXT NOT NULL,
    at          TEXT NOT NULL,
    reason      TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
) STRICT;
