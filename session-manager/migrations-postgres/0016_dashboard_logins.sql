-- The web dashboard's logins. A login link (`devctl dashboard`) is single-use and short-lived;
-- redeeming it makes a browser login whose token is the dashboard's session cookie. Only
-- SHA-256 digests of both tokens are stored. The identity is the one the link was made with
-- (DN, FQANs, the credential's kind and end), so admin rights are decided again on every request.
CREATE TABLE dashboard_links (
    token_hash TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    user_dn TEXT COLLATE "C" NOT NULL,
    fqans TEXT COLLATE "C" NOT NULL,
    credential_kind TEXT COLLATE "C" NOT NULL,
    credential_not_after TEXT COLLATE "C" NOT NULL,
    created_at TEXT COLLATE "C" NOT NULL,
    expires_at TEXT COLLATE "C" NOT NULL,
    used_at TEXT COLLATE "C"
);

CREATE TABLE dashboard_logins (
    token_hash TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    user_dn TEXT COLLATE "C" NOT NULL,
    fqans TEXT COLLATE "C" NOT NULL,
    credential_kind TEXT COLLATE "C" NOT NULL,
    -- The per-login token every state-changing form carries (CSRF).
    csrf_token TEXT COLLATE "C" NOT NULL,
    created_at TEXT COLLATE "C" NOT NULL,
    expires_at TEXT COLLATE "C" NOT NULL
);

CREATE INDEX dashboard_logins_expiry ON dashboard_logins (expires_at);
CREATE INDEX dashboard_links_expiry ON dashboard_links (expires_at);
