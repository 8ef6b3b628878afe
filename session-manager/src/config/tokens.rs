//! `[[token_issuers]]`: the OAuth2 token issuers whose bearer tokens (WLCG common JWT profile,
//! SciTokens) the manager accepts beside grid certificates (see [`crate::tokens`]).
//!
//! ```toml
//! [[token_issuers]]
//! name = "wlcg"                                    # in token users' names and the logs
//! issuer = "https://iam.site.invalid/"            # the `iss` claim, exactly
//! audience = ["https://ongrid.example.org:8443"]   # accepted `aud` values
//! any_audience = false                             # also accept https://wlcg.cern.ch/jwt/v1/any
//! jwks_file = "/etc/ongrid/wlcg-jwks.json"         # keys from a file instead of the issuer's discovery
//! ca_file = "/etc/ssl/certs/ca-certificates.crt"   # CAs for the issuer's https (this is the default)
//! vos = ["cms"]                                    # keep only these VOs' groups (default: all)
//! key_lifetime = "12 hours"                        # SSH keys registered with its tokens (default: the token's own)
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use ongrid_core::HumanDuration;
use serde::Deserialize;

/// The WLCG profile's audience that every service accepts when it chooses to.
pub const WLCG_ANY_AUDIENCE: &str = "https://wlcg.cern.ch/jwt/v1/any";

/// Where the CA bundle of the operating system is, Debian's first, then Enterprise Linux's.
const SYSTEM_CA_BUNDLES: [&str; 2] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
];

/// The longest `key_lifetime`: an SSH key outliving its token by more than this is a password.
const LONGEST_KEY_LIFETIME: Duration = Duration::from_secs(14 * 24 * 3600);

/// One `[[token_issuers]]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTokenIssuer {
    pub name: String,
    pub issuer: String,
    #[serde(default)]
    pub audience: Vec<String>,
    #[serde(default)]
    pub any_audience: bool,
    #[serde(default)]
    pub jwks_file: Option<PathBuf>,
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub vos: Vec<String>,
    #[serde(default)]
    pub key_lifetime: Option<String>,
}

/// One trusted issuer, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenIssuer {
    /// Lower-case letters, digits and `-`: part of the names of its tokens' users, so it must
    /// never change once users exist.
    pub name: String,
    /// The `iss` claim of its tokens, exactly (an `https://` URL).
    pub issuer: String,
    /// Accepted `aud` values (with [`WLCG_ANY_AUDIENCE`] when the site accepts it).
    pub audiences: Vec<String>,
    /// Where its keys come from.
    pub keys: KeySource,
    /// Only groups of these VOs are kept; empty: all.
    pub vos: Vec<String>,
    /// How long an SSH key registered with one of its tokens lives; `None`: until the token
    /// expires.
    pub key_lifetime: Option<Duration>,
}

/// Where an issuer's signing keys (a JWK set) are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// The `jwks_uri` of `<issuer>/.well-known/openid-configuration`, over https checked
    /// against the CAs of `ca_file`.
    Discovery { ca_file: PathBuf },
    /// A JWK set file the site keeps (a site without outbound access): read again when it
    /// changes.
    File(PathBuf),
}

/// The issuers of `raw`, or the key and what is wrong with it.
pub fn token_issuers(raw: &[RawTokenIssuer]) -> Result<Vec<TokenIssuer>, (String, String)> {
    let mut issuers: Vec<TokenIssuer> = Vec::with_capacity(raw.len());
    for (index, entry) in raw.iter().enumerate() {
        let key = |field: &str| format!("token_issuers[{index}].{field}");
        let issuer = token_issuer(entry, &key, system_ca_bundle)?;
        if issuers.iter().any(|other| other.name == issuer.name) {
            return Err((
                key("name"),
                format!("{:?} names two issuers: give each its own", issuer.name),
            ));
        }
        if issuers.iter().any(|other| other.issuer == issuer.issuer) {
            return Err((
                key("issuer"),
                format!("{:?} is listed twice: one entry per issuer", issuer.issuer),
            ));
        }
        issuers.push(issuer);
    }
    Ok(issuers)
}

fn token_issuer(
    raw: &RawTokenIssuer,
    key: &dyn Fn(&str) -> String,
    default_ca_file: fn() -> Option<PathBuf>,
) -> Result<TokenIssuer, (String, String)> {
    Ok(TokenIssuer {
        name: issuer_name(raw, key)?,
        issuer: issuer_url(raw, key)?,
        audiences: audiences(raw, key)?,
        keys: key_source(raw, key, default_ca_file)?,
        vos: vos(raw, key)?,
        key_lifetime: key_lifetime(raw, key)?,
    })
}

/// `name`: 1 to 32 lower-case letters, digits or '-'.
fn issuer_name(
    raw: &RawTokenIssuer,
    key: &dyn Fn(&str) -> String,
) -> Result<String, (String, String)> {
    let name = raw.name.trim();
    if name.is_empty()
        || name.len() > 32
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err((
            key("name"),
            format!(
                "{name:?} must be 1 to 32 lower-case letters, digits or '-', like \"wlcg\" or \
                 \"cms-iam\""
            ),
        ));
    }
    Ok(name.to_owned())
}

/// `issuer`: the issuer's https URL, as its tokens' `iss` says.
fn issuer_url(
    raw: &RawTokenIssuer,
    key: &dyn Fn(&str) -> String,
) -> Result<String, (String, String)> {
    let issuer = raw.issuer.trim();
    if !issuer.starts_with("https://") || issuer.len() <= "https://".len() {
        return Err((
            key("issuer"),
            format!(
                "{issuer:?} must be the issuer's https URL, exactly as its tokens' iss claim \
                 says, like \"https://<issuer host>/\""
            ),
        ));
    }
    Ok(issuer.to_owned())
}

/// `audience`, each once, with the WLCG profile's "any" audience when `any_audience`; at
/// least one.
fn audiences(
    raw: &RawTokenIssuer,
    key: &dyn Fn(&str) -> String,
) -> Result<Vec<String>, (String, String)> {
    let mut audiences: Vec<String> = Vec::new();
    for audience in &raw.audience {
        let audience = audience.trim();
        if audience.is_empty() {
            return Err((key("audience"), "an empty audience: remove it".to_owned()));
        }
        if !audiences.iter().any(|a| a == audience) {
            audiences.push(audience.to_owned());
        }
    }
    if raw.any_audience && !audiences.iter().any(|a| a == WLCG_ANY_AUDIENCE) {
        audiences.push(WLCG_ANY_AUDIENCE.to_owned());
    }
    if audiences.is_empty() {
        return Err((
            key("audience"),
            "no audience: list this site's, like [\"https://<manager host>:8443\"] (what \
             users ask their tokens for), or set any_audience = true to accept the WLCG \
             profile's https://wlcg.cern.ch/jwt/v1/any"
                .to_owned(),
        ));
    }
    Ok(audiences)
}

/// Where the issuer's keys come from: `jwks_file`, or the issuer's discovery with `ca_file`
/// (the system's CA bundle when not set).
fn key_source(
    raw: &RawTokenIssuer,
    key: &dyn Fn(&str) -> String,
    default_ca_file: fn() -> Option<PathBuf>,
) -> Result<KeySource, (String, String)> {
    Ok(match (&raw.jwks_file, &raw.ca_file) {
        (Some(file), _) if file.as_os_str().is_empty() => {
            return Err((
                key("jwks_file"),
                "an empty path: name the JWK set file".to_owned(),
            ))
        }
        (Some(_), Some(_)) => {
            return Err((
                key("ca_file"),
                "ca_file is for fetching keys from the issuer; with jwks_file nothing is \
                 fetched: remove one of them"
                    .to_owned(),
            ))
        }
        (Some(file), None) => KeySource::File(file.clone()),
        (None, Some(ca_file)) => KeySource::Discovery {
            ca_file: ca_file.clone(),
        },
        (None, None) => KeySource::Discovery {
            ca_file: default_ca_file().ok_or_else(|| {
                (
                    key("ca_file"),
                    format!(
                        "no CA bundle found at {}: name the CAs that sign the issuer's https \
                         certificate, or give its keys as jwks_file",
                        SYSTEM_CA_BUNDLES.join(" or ")
                    ),
                )
            })?,
        },
    })
}

/// `vos`: VO names (a leading '/' allowed), no group path.
fn vos(
    raw: &RawTokenIssuer,
    key: &dyn Fn(&str) -> String,
) -> Result<Vec<String>, (String, String)> {
    let mut vos = Vec::new();
    for vo in &raw.vos {
        let vo = vo.trim().trim_start_matches('/');
        if vo.is_empty() || vo.contains('/') {
            return Err((
                key("vos"),
                format!("{vo:?} must be a VO's name, like \"cms\" (the first part of its groups)"),
            ));
        }
        vos.push(vo.to_owned());
    }
    Ok(vos)
}

/// `key_lifetime`: more than 0 and at most 14 days, when set.
fn key_lifetime(
    raw: &RawTokenIssuer,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<Duration>, (String, String)> {
    raw.key_lifetime
        .as_deref()
        .map(|text| {
            let lifetime = HumanDuration::parse(text)
                .map_err(|e| (key("key_lifetime"), format!("{text:?}: {e}")))?
                .as_duration();
            if lifetime.is_zero() || lifetime > LONGEST_KEY_LIFETIME {
                return Err((
                    key("key_lifetime"),
                    format!("{text:?} must be more than 0 and at most 14 days"),
                ));
            }
            Ok(lifetime)
        })
        .transpose()
}

fn system_ca_bundle() -> Option<PathBuf> {
    SYSTEM_CA_BUNDLES
        .iter()
        .map(Path::new)
        .find(|path| path.is_file())
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(toml_text: &str) -> RawTokenIssuer {
        toml::from_str(toml_text).unwrap()
    }

    fn check(raw: &RawTokenIssuer) -> Result<TokenIssuer, (String, String)> {
        token_issuer(raw, &|field| format!("token_issuers[0].{field}"), || {
            Some(PathBuf::from("/bundle.crt"))
        })
    }

    #[test]
    fn an_issuer_with_its_audience_fetches_its_keys_over_https() {
        let issuer = check(&raw(r#"name = "wlcg"
               issuer = "https://iam.test.invalid/"
               audience = ["https://ongrid.test.invalid:8443"]
               any_audience = true
               vos = ["/cms", "atlas"]
               key_lifetime = "12 hours""#))
        .unwrap();
        assert_eq!(issuer.name, "wlcg");
        assert_eq!(
            issuer.audiences,
            ["https://ongrid.test.invalid:8443", WLCG_ANY_AUDIENCE]
        );
        assert_eq!(
            issuer.keys,
            KeySource::Discovery {
                ca_file: PathBuf::from("/bundle.crt")
            }
        );
        assert_eq!(issuer.vos, ["cms", "atlas"]);
        assert_eq!(issuer.key_lifetime, Some(Duration::from_secs(12 * 3600)));
    }

    #[test]
    fn mistakes_name_the_key_and_the_fix() {
        let refused = |text: &str| check(&raw(text)).unwrap_err();
        let (key, message) = refused(
            r#"name = "WLCG IAM"
            issuer = "https://iam.test.invalid/"
            audience = ["a"]"#,
        );
        assert_eq!(key, "token_issuers[0].name");
        assert!(message.contains("lower-case"), "{message}");
        let (key, message) = refused(
            r#"name = "iam"
            issuer = "http://iam.test.invalid/"
            audience = ["a"]"#,
        );
        assert_eq!(key, "token_issuers[0].issuer");
        assert!(message.contains("https URL"), "{message}");
        let (key, message) = refused(
            r#"name = "iam"
            issuer = "https://iam.test.invalid/""#,
        );
        assert_eq!(key, "token_issuers[0].audience");
        assert!(message.contains("any_audience"), "{message}");
        let (key, message) = refused(
            r#"name = "iam"
            issuer = "https://iam.test.invalid/"
            audience = ["a"]
            jwks_file = "/etc/ongrid/keys.json"
            ca_file = "/etc/ssl/ca.crt""#,
        );
        assert_eq!(key, "token_issuers[0].ca_file");
        assert!(message.contains("remove one"), "{message}");
        let (key, message) = refused(
            r#"name = "iam"
            issuer = "https://iam.test.invalid/"
            audience = ["a"]
            key_lifetime = "30 days""#,
        );
        assert_eq!(key, "token_issuers[0].key_lifetime");
        assert!(message.contains("14 days"), "{message}");
    }

    #[test]
    fn a_jwks_file_replaces_discovery_and_duplicates_are_refused() {
        let entry = raw(r#"name = "local"
            issuer = "https://iam.test.invalid/"
            audience = ["https://ongrid.test.invalid:8443"]
            jwks_file = "/etc/ongrid/keys.json""#);
        assert_eq!(
            check(&entry).unwrap().keys,
            KeySource::File(PathBuf::from("/etc/ongrid/keys.json"))
        );
        let (key, message) = token_issuers(&[entry.clone(), entry]).unwrap_err();
        assert_eq!(key, "token_issuers[1].name");
        assert!(message.contains("two issuers"), "{message}");
    }
}
