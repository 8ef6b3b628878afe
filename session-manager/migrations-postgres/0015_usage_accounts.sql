-- Fair share (site policy): each user's accounting group, as the site's [policy] last admitted
-- them, and their GPU usage in cost-weighted GPU-hours, decayed to updated_at.
CREATE TABLE usage_accounts (
    user_dn TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    accounting_group TEXT COLLATE "C" NOT NULL,
    usage DOUBLE PRECISION NOT NULL DEFAULT 0,
    updated_at TEXT COLLATE "C" NOT NULL
);
