//! `devctl key add|ls|rm`: the SSH public keys that reach the caller's sessions
//! (`POST /v1/keys`, `GET /v1/keys[?all=true]`, `DELETE /v1/keys?fingerprint=...`). A key is
//! bound to the identity of the certificate, proxy or bearer token it was added with and expires
//! with it (with a token, at the site's maximum if that is sooner).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use ongrid_core::api::{AddKey, KeyView};

use crate::client::Client;
use crate::format::format_time;
use crate::pubkey;
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Register an SSH public key for your identity, until your certificate or token expires
    ///
    /// Adding a key that is already yours renews its expiry to your current certificate's or
    /// token's.
    Add(KeyAddArgs),
    /// List your SSH keys with their fingerprints and expiry
    #[command(alias = "list")]
    Ls(KeyLsArgs),
    /// Remove an SSH key by its fingerprint, as devctl key ls shows it
    #[command(alias = "remove")]
    Rm(KeyRmArgs),
}

#[derive(Debug, Clone, Args)]
pub struct KeyAddArgs {
    /// The public key file [default: ~/.ssh/id_ed25519.pub, else ~/.ssh/id_ecdsa.pub, else
    /// ~/.ssh/id_rsa.pub]
    #[arg(value_name = "PUBKEY_FILE")]
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct KeyLsArgs {
    /// Everybody's keys (admins only)
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct KeyRmArgs {
    /// The key's fingerprint, like SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI
    pub fingerprint: Fingerprint,
    #[command(flatten)]
    pub output: JsonArgs,
}

/// An SSH key fingerprint as `ssh-keygen -l` prints it: `SHA256:` and 43 base64 characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(String);

impl Fingerprint {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Fingerprint {
    type Err = String;
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let problem = || {
            format!(
                "fingerprint {value:?} must look like SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI, \
                 as devctl key ls shows it"
            )
        };
        let hash = value
            .trim()
            .strip_prefix("SHA256:")
            .ok_or_else(problem)?
            // ssh-keygen leaves out base64's padding; accept a pasted one.
            .trim_end_matches('=');
        let base64 = |b: u8| b.is_ascii_alphanumeric() || b == b'+' || b == b'/';
        if hash.len() != 43 || !hash.bytes().all(base64) {
            return Err(problem());
        }
        Ok(Self(format!("SHA256:{hash}")))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What `POST /v1/keys` did with the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyAdded {
    /// 201: the key is new.
    New,
    /// 200: the key was already the caller's; its expiry now follows the presented certificate.
    Renewed,
}

/// Runs `devctl key ...`; `home` is where `key add` looks for `~/.ssh`.
pub async fn run(
    command: KeyCommand,
    client: &Client,
    home: Option<&Path>,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        KeyCommand::Add(args) => add(args, client, home, term).await,
        KeyCommand::Ls(KeyLsArgs { all, output }) => {
            let keys: Vec<KeyView> = client.get("v1/keys").all(all).send().await?;
            let width = term.width;
            term.show(output.json, &keys, |keys| {
                render_keys(keys, all, Utc::now(), width)
            })
        }
        KeyCommand::Rm(KeyRmArgs {
            fingerprint,
            output,
        }) => {
            let key: KeyView = remove_request(client, &fingerprint).send().await?;
            term.show(output.json, &key, render_key_removed)
        }
    }
}

async fn add(
    args: KeyAddArgs,
    client: &Client,
    home: Option<&Path>,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let key = pubkey::load(args.file.as_deref(), home)?;
    term.note(&format!("public key file: {}", key.path.display()));
    let body = AddKey {
        public_key: key.line,
    };
    let (status, view): (u16, KeyView) = client
        .post("v1/keys")
        .json(&body)
        .if_lost("the key may have been added: devctl key ls")
        .send_with_status()
        .await?;
    let added = if status == 201 {
        KeyAdded::New
    } else {
        KeyAdded::Renewed
    };
    let token_source = client.context().token_source.as_deref();
    term.show(args.output.json, &view, |view| {
        render_key_added(view, added == KeyAdded::Renewed, token_source)
    })
}

/// `DELETE /v1/keys?fingerprint=SHA256:...`, the fingerprint URL-encoded (its base64 holds `+`
/// and `/`).
fn remove_request<'a>(client: &'a Client, fingerprint: &Fingerprint) -> crate::client::Request<'a> {
    client
        .delete("v1/keys")
        .query(&[("fingerprint", fingerprint.as_str())])
}

/// `ssh-ed25519, alice@laptop`, or the algorithm alone when the key has no comment.
fn key_kind(key: &KeyView) -> String {
    if key.comment.is_empty() {
        key.algorithm.clone()
    } else {
        format!("{}, {}", key.algorithm, key.comment)
    }
}

/// `devctl key add`: what was registered, and until when; `token_source` is where the bearer
/// token sent came from, if one was.
pub fn render_key_added(key: &KeyView, renewed: bool, token_source: Option<&str>) -> String {
    let done = if renewed {
        "was already yours: renewed"
    } else {
        "added"
    };
    let with = match token_source {
        Some(source) => format!("with the bearer token from {source}, or the site's maximum"),
        None => "with the certificate or proxy used".to_owned(),
    };
    format!(
        "key {} ({}) {done}\nexpires {} ({with})\n",
        key.fingerprint,
        key_kind(key),
        format_time(key.expires_at)
    )
}

pub fn render_key_removed(key: &KeyView) -> String {
    format!("key {} ({}) removed\n", key.fingerprint, key_kind(key))
}

/// `devctl key ls`; with `all`, each key's owner too. Keys expired at `now` are marked. Wrapped
/// to `width` (the terminal's) when given.
pub fn render_keys(keys: &[KeyView], all: bool, now: DateTime<Utc>, width: Option<u16>) -> String {
    if keys.is_empty() {
        return if all {
            "no SSH keys registered\n".to_owned()
        } else {
            "no SSH keys: register yours with devctl key add\n".to_owned()
        };
    }
    let mut headers = vec!["FINGERPRINT", "TYPE", "COMMENT"];
    if all {
        headers.push("OWNER");
    }
    headers.extend(["ADDED", "EXPIRES"]);
    let mut table = Table::new(&headers);
    // Fingerprints and times stay whole; comments and owners wrap.
    table.keep_whole(&[0, 1]);
    for key in keys {
        let mut row = vec![
            key.fingerprint.clone(),
            key.algorithm.clone(),
            if key.comment.is_empty() {
                "-".to_owned()
            } else {
                key.comment.clone()
            },
        ];
        if all {
            row.push(key.owner.to_string());
        }
        let mut expires = format_time(key.expires_at);
        if key.expires_at <= now {
            expires.push_str(" (expired: devctl key add renews it)");
        }
        row.extend([format_time(key.added_at), expires]);
        table.row(row);
    }
    table.render(width, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::Dn;

    fn at(secs: i64) -> DateTime<Utc> {
        // 2026-11-21 10:00:00Z
        DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
    }

    fn key(comment: &str, expires: i64) -> KeyView {
        KeyView {
            fingerprint: "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI".into(),
            algorithm: "ssh-ed25519".into(),
            comment: comment.into(),
            owner: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
            added_at: at(0),
            expires_at: at(expires),
        }
    }

    #[test]
    fn key_add_says_what_and_until_when() {
        assert_eq!(
            render_key_added(&key("alice@laptop", 86_400), false, None),
            "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519, alice@laptop) \
             added\nexpires 2026-11-22 10:00:00Z (with the certificate or proxy used)\n"
        );
        assert_eq!(
            render_key_added(&key("", 60), true, None),
            "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519) was already \
             yours: renewed\nexpires 2026-11-21 10:01:00Z (with the certificate or proxy used)\n"
        );
        assert_eq!(
            render_key_added(
                &key("", 60),
                false,
                Some("BEARER_TOKEN_FILE /run/user/1000/bt_u1000")
            ),
            "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519) added\nexpires \
             2026-11-21 10:01:00Z (with the bearer token from BEARER_TOKEN_FILE \
             /run/user/1000/bt_u1000, or the site's maximum)\n"
        );
        assert_eq!(
            render_key_removed(&key("alice@laptop", 60)),
            "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519, alice@laptop) \
             removed\n"
        );
    }

    #[test]
    fn key_list_marks_expired_keys_and_owners_for_all() {
        let keys = [key("alice@laptop", 86_400), key("", 60)];
        assert_eq!(
            render_keys(&keys, false, at(120), None),
            "FINGERPRINT                                         TYPE         COMMENT       ADDED                 EXPIRES
SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  ssh-ed25519  alice@laptop  2026-11-21 10:00:00Z  2026-11-22 10:00:00Z
SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  ssh-ed25519  -             2026-11-21 10:00:00Z  2026-11-21 10:01:00Z (expired: devctl key add renews it)
"
        );
        let all = render_keys(&keys, true, at(0), None);
        assert!(all.lines().next().unwrap().contains("  OWNER  "), "{all}");
        assert!(all.contains("/DC=org/DC=example/CN=Alice Smith"), "{all}");
        assert!(!all.contains("expired"), "{all}");
        assert_eq!(
            render_keys(&[], false, at(0), None),
            "no SSH keys: register yours with devctl key add\n"
        );
    }

    #[test]
    fn fingerprints_are_url_encoded() {
        let client = Client::for_building_requests("https://manager.example.org:8443/");
        let fingerprint: Fingerprint = "SHA256:ab+c/dJHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2x="
            .parse()
            .unwrap();
        let request = remove_request(&client, &fingerprint).build();
        assert_eq!(request.method(), reqwest::Method::DELETE);
        assert_eq!(
            request.url().as_str(),
            "https://manager.example.org:8443/v1/keys?fingerprint=SHA256%3Aab%2Bc%2FdJHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2x"
        );
    }
}
