-- ongrid-manager schema, version 10: admins remove users (`devctl admin user rm`) and restore
-- them. Never edit a migration once released.

-- A removed user's row stays, so the audit log and their ENDED sessions still name them and
-- their login name and UID are never reused: removed_at and removed_by (the admin's DN) are set
-- while they are removed, NULL otherwise.
ALTER TABLE users ADD COLUMN removed_at TEXT COLLATE "C";
ALTER TABLE users ADD COLUMN removed_by TEXT COLLATE "C";

-- What admins did to a user, oldest first: action is 'removed' or 'restored', by the admin's
-- DN, details what went with it.
CREATE TABLE user_events (
    dn       TEXT COLLATE "C" NOT NULL REFERENCES users(dn),
    seq      BIGINT NOT NULL,
    at       TEXT COLLATE "C" NOT NULL,
    action   TEXT COLLATE "C" NOT NULL,
    by       TEXT COLLATE "C" NOT NULL,
    details  TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (dn, seq)
);
