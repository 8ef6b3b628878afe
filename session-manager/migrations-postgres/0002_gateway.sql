-- ongrid-manager schema, version 2: the SSH gateway. Never edit a migration once released.
-- Times are RFC 3339 UTC text with nanoseconds, as in 0001.

-- Where the gateway reaches the node's agent for SSH streams (wss://...); NULL when the agent
-- has no [streams] section, and then no session on the node is reachable over SSH.
ALTER TABLE nodes ADD COLUMN stream_url TEXT COLLATE "C";

-- An SSH public key bound to a user. fingerprint: "SHA256:<base64>" of the key; public_key:
-- the key in OpenSSH's one-line format without its comment. The key is refused after
-- expires_at, the notAfter of the certificate it was registered with.
CREATE TABLE ssh_keys (
    fingerprint  TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    owner        TEXT COLLATE "C" NOT NULL REFERENCES users(dn),
    algorithm    TEXT COLLATE "C" NOT NULL,
    public_key   TEXT COLLATE "C" NOT NULL,
    comment      TEXT COLLATE "C" NOT NULL,
    added_at     TEXT COLLATE "C" NOT NULL,
    expires_at   TEXT COLLATE "C" NOT NULL
);
CREATE INDEX ssh_keys_owner ON ssh_keys(owner);

-- An institute allowed to reach the gateway. cidrs: a JSON array of networks as text
-- ("192.0.2.0/24", "2001:db8::/32"), at least one.
CREATE TABLE institutes (
    name        TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    cidrs       TEXT COLLATE "C" NOT NULL,
    created_at  TEXT COLLATE "C" NOT NULL
);

-- The audit log: one row per SSH connection the gateway reported. closed_at is NULL while it
-- is open; bytes are the totals of the last report (in: client to container). owner and
-- institute are kept as reported, with no reference, so that the log outlives users' keys and
-- removed institutes.
CREATE TABLE connections (
    id           TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    owner        TEXT COLLATE "C" NOT NULL,
    fingerprint  TEXT COLLATE "C" NOT NULL,
    source       TEXT COLLATE "C" NOT NULL,
    institute    TEXT COLLATE "C" NOT NULL,
    session_id   TEXT COLLATE "C" NOT NULL REFERENCES sessions(id),
    opened_at    TEXT COLLATE "C" NOT NULL,
    closed_at    TEXT COLLATE "C",
    bytes_in     BIGINT NOT NULL DEFAULT 0,
    bytes_out    BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX connections_opened ON connections(opened_at);
CREATE INDEX connections_owner ON connections(owner, opened_at);
CREATE INDEX connections_open ON connections(session_id) WHERE closed_at IS NULL;
