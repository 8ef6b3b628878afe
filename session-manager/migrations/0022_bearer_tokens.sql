-- Bearer tokens (WLCG common JWT profile, SciTokens) beside certificates.
-- The issuer (its name in the config) of the token each SSH key was last registered with, so
-- that the refusal of an expired key names the token tools; NULL: a certificate or proxy.
ALTER TABLE ssh_keys ADD COLUMN token_issuer TEXT;

-- Token identities an admin linked to the user of a DN (`devctl admin user link`): tokens of
-- that issuer (its iss URL) and subject act as that user. Unlinked, a token's user is named by
-- the issuer and subject alone.
CREATE TABLE token_links (
    issuer TEXT NOT NULL,
    subject TEXT NOT NULL,
    dn TEXT NOT NULL,
    linked_at TEXT NOT NULL,
    PRIMARY KEY (issuer, subject)
) STRICT;
