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
    id             TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    owner          TEXT COLLATE "C" NOT NULL REFERENCES users(dn),
    name           TEXT COLLATE "C" NOT NULL,
    version        TEXT COLLATE "C" NOT NULL,
    state          TEXT COLLATE "C" NOT NULL,
    reason         TEXT COLLATE "C" NOT NULL,
    session_id     TEXT COLLATE "C" NOT NULL REFERENCES sessions(id),
    session_name   TEXT COLLATE "C" NOT NULL,
    node           TEXT COLLATE "C" NOT NULL REFERENCES nodes(name),
    base_image     TEXT COLLATE "C" NOT NULL,
    compression    TEXT COLLATE "C" NOT NULL,
    digest         TEXT COLLATE "C",
    size           BIGINT,
    sif_path       TEXT COLLATE "C",
    docker_image   TEXT COLLATE "C",
    bytes_done     BIGINT NOT NULL DEFAULT 0,
    bytes_total    BIGINT NOT NULL DEFAULT 0,
    progress_at    TEXT COLLATE "C" NOT NULL,
    created_at     TEXT COLLATE "C" NOT NULL,
    finished_at    TEXT COLLATE "C",
    superseded_at  TEXT COLLATE "C"
);
-- One current image per tag and owner.
CREATE UNIQUE INDEX images_current_tag ON images(owner, name, version)
    WHERE state <> 'DELETED' AND superseded_at IS NULL;
CREATE INDEX images_building ON images(node) WHERE state = 'BUILDING';
CREATE INDEX images_digest ON images(digest);
