-- ongrid-manager schema, version 5: frozen images. Never edit a migration once released.
-- Times are RFC 3339 UTC text with nanoseconds, as in 0001.

-- A frozen image: a session turned into a SIF file in the image store (content-addressed,
-- `<store>/sha256/<hex>.sif`) and a matching Docker image on the session's node.
-- state: BUILDING, READY, FAILED or DELETED; reason: why (a FAILED image's reason).
-- bytes_done/bytes_total: the agent's last progress report while BUILDING; progress_at: when
-- they last changed (or the freeze was requested), so a stalled freeze can be failed.
-- superseded_at: set when `freeze --force` moved the tag (owner, name, version) to a newer
-- image; the superseded one stays reachable by its digest.
CREATE TABLE images (
    id             TEXT PRIMARY KEY NOT NULL,
    owner          TEXT NOT NULL REFERENCES users(dn),
    name           TEXT NOT NULL,
    version        TEXT NOT NULL,
    state          TEXT NOT NULL,
    reason         TEXT NOT NULL,
    session_id     TEXT NOT NULL REFERENCES sessions(id),
    session_name   TEXT NOT NULL,
    node           TEXT NOT NULL REFERENCES nodes(name),
    base_image     TEXT NOT NULL,
    compression    TEXT NOT NULL,
    digest         TEXT,
    size           INTEGER,
    sif_path       TEXT,
    docker_image   TEXT,
    bytes_done     INTEGER NOT NULL DEFAULT 0,
    bytes_total    INTEGER NOT NULL DEFAULT 0,
    progress_at    TEXT NOT NULL,
    created_at     TEXT NOT NULL,
    finished_at    TEXT,
    superseded_at  TEXT
) STRICT;
-- One current image per tag and owner.
CREATE UNIQUE INDEX images_current_tag ON images(owner, name, version)
    WHERE state <> 'DELETED' AND superseded_at IS NULL;
CREATE INDEX images_building ON images(node) WHERE state = 'BUILDING';
CREATE INDEX images_digest ON images(digest);
