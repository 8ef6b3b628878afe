//! [`HostFirewall`] with the node's iptables (`/usr/sbin/iptables`, whichever backend the
//! node's Docker uses; Debian's default is nf_tables; `[network] iptables` names another
//! program, such as `iptables-legacy`, or a wrapper that enters the network namespace of a
//! Docker shared by several agents, as the multi-node end-to-end test does).
//!
//! [`Iptables::ensure`] compares the chains (`iptables -t <table> -S <chain>`) and the two jumps
//! (`iptables -t <table> -C`) with the [`Ruleset`]; when anything differs it replaces both
//! chains, each in one `iptables-restore --noflush` transaction of its table (never an empty,
//! open moment), inserts a missing jump first in its chain, and then removes the forward chain
//! that agents before it kept behind `DOCKER-USER`. [`Iptables::remove_blocking`] takes
//! everything out again: the agent when it stops with no container left on the node (with
//! containers it leaves the rules, so they stay isolated until the next agent), and the tests.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use futures::future::BoxFuture;
use ongrid_core::NodeName;

use super::{
    FirewallError, FirewallState, HostFirewall, NetworkPolicy, Ruleset, DOCKER_USER, FILTER,
    FORWARD, INPUT, MANGLE,
};

/// Where Debian puts iptables.
pub const IPTABLES: &str = "/usr/sbin/iptables";

/// The `iptables-restore` that goes with the iptables program `iptables`: `<iptables>-restore`
/// (`/usr/sbin/iptables-legacy` → `/usr/sbin/iptables-legacy-restore`).
pub fn restore_program(iptables: &Path) -> PathBuf {
    let mut name = iptables.as_os_str().to_owned();
    name.push("-restore");
    PathBuf::from(name)
}

/// The rules of one node on this host's iptables.
#[derive(Debug, Clone)]
pub struct Iptables {
    rules: Ruleset,
    iptables: PathBuf,
    restore: PathBuf,
}

impl Iptables {
    /// The rules of `node` with the node's iptables at [`IPTABLES`].
    pub fn new(node: &NodeName, policy: &NetworkPolicy) -> Self {
        Self::with_program(node, policy, Path::new(IPTABLES))
    }

    /// The rules of `node`, run with the iptables program `iptables` (`[network] iptables`).
    pub fn with_program(node: &NodeName, policy: &NetworkPolicy, iptables: &Path) -> Self {
        Self {
            rules: Ruleset::new(node, policy),
            iptables: iptables.to_path_buf(),
            restore: restore_program(iptables),
        }
    }

    pub fn rules(&self) -> &Ruleset {
        &self.rules
    }

    /// Checks the rules and installs what is missing or different (blocking: a few short
    /// iptables runs).
    pub fn ensure_blocking(&self) -> Result<FirewallState, FirewallError> {
        if !self.chain_exists(FILTER, DOCKER_USER)? {
            return Err(FirewallError::NoDockerUser);
        }
        let chains_ok = self.chains_read_back()?;
        if !chains_ok {
            // The jumps can only be checked once their targets exist.
            self.restore(&self.rules.restore_script())?;
        }
        let input_jump = self.ensure_first(FILTER, INPUT, &self.rules.input_jump())?;
        let forward_jump = self.ensure_first(MANGLE, FORWARD, &self.rules.forward_jump())?;
        // An agent from before the forward chain moved to mangle left it in filter, behind
        // DOCKER-USER, with the policy of its day. Removed only once the new jump is in place,
        // so that no moment passes without one, and looked for at every check, so that a
        // removal that failed is tried again.
        let legacy_removed = self.remove_forward_from_docker_user()?;
        if chains_ok && input_jump && forward_jump && !legacy_removed {
            return Ok(FirewallState::InPlace);
        }
        if !self.chains_read_back()? {
            return Err(FirewallError::Mismatch(format!(
                "{} or {}",
                self.rules.input_chain, self.rules.forward_chain
            )));
        }
        Ok(FirewallState::Installed)
    }

    /// Removes the jumps and the chains (whatever is there; missing parts are not an error;
    /// blocking: a few short iptables runs).
    pub fn remove_blocking(&self) -> Result<(), FirewallError> {
        let rules = &self.rules;
        self.remove_chain(FILTER, INPUT, &rules.input_chain, &rules.input_jump())?;
        self.remove_chain(MANGLE, FORWARD, &rules.forward_chain, &rules.forward_jump())?;
        self.remove_forward_from_docker_user()?;
        Ok(())
    }

    /// Removes the forward chain from where agents before the move to mangle kept it; whether
    /// it was there.
    fn remove_forward_from_docker_user(&self) -> Result<bool, FirewallError> {
        let rules = &self.rules;
        self.remove_chain(
            FILTER,
            DOCKER_USER,
            &rules.forward_chain,
            &rules.forward_jump(),
        )
    }

    /// Whether both chains hold exactly their rules.
    fn chains_read_back(&self) -> Result<bool, FirewallError> {
        Ok(
            self.chain_is(FILTER, &self.rules.input_chain, &self.rules.input_rules)?
                && self.chain_is(MANGLE, &self.rules.forward_chain, &self.rules.forward_rules)?,
        )
    }

    /// Puts `rule` first in `chain` unless it is there; whether it was.
    fn ensure_first(&self, table: &str, chain: &str, rule: &str) -> Result<bool, FirewallError> {
        if self.has_rule(table, chain, rule)? {
            return Ok(true);
        }
        self.run(&["-t", table, "-I", chain, "1"], rule)?;
        Ok(false)
    }

    /// Removes every `jump` from `from` to `chain` in `table`, then `chain` itself, where
    /// they exist; whether `chain` did.
    fn remove_chain(
        &self,
        table: &str,
        from: &str,
        chain: &str,
        jump: &str,
    ) -> Result<bool, FirewallError> {
        // A jump can only exist while its target chain does.
        if !self.chain_exists(table, chain)? {
            return Ok(false);
        }
        if self.chain_exists(table, from)? {
            while self.has_rule(table, from, jump)? {
                self.run(&["-t", table, "-D", from], jump)?;
            }
        }
        self.run(&["-t", table, "-F", chain], "")?;
        self.run(&["-t", table, "-X", chain], "")?;
        Ok(true)
    }

    fn chain_exists(&self, table: &str, chain: &str) -> Result<bool, FirewallError> {
        Ok(self.output(&["-t", table, "-S", chain])?.is_some())
    }

    /// Whether `chain` of `table` holds exactly `rules`, in order.
    fn chain_is(&self, table: &str, chain: &str, rules: &[String]) -> Result<bool, FirewallError> {
        let Some(listing) = self.output(&["-t", table, "-S", chain])? else {
            return Ok(false);
        };
        let prefix = format!("-A {chain} ");
        let present: Vec<&str> = listing
            .lines()
            .filter_map(|line| line.strip_prefix(&prefix))
            .collect();
        Ok(present == rules.iter().map(String::as_str).collect::<Vec<_>>())
    }

    fn has_rule(&self, table: &str, chain: &str, rule: &str) -> Result<bool, FirewallError> {
        let mut args = vec!["-t", table, "-C", chain];
        args.extend(rule.split_whitespace());
        Ok(self.output(&args)?.is_some())
    }

    /// Runs iptables with `args` and then the words of `rule`; fails with its stderr.
    fn run(&self, args: &[&str], rule: &str) -> Result<(), FirewallError> {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(rule.split_whitespace());
        let output = self.command(&all)?;
        if output.status.success() {
            Ok(())
        } else {
            Err(self.failed(&all, &output.stderr))
        }
    }

    /// iptables' stdout when it succeeds, `None` when it exits with 1 (no such chain or rule);
    /// anything else (no permission, no binary) is an error.
    fn output(&self, args: &[&str]) -> Result<Option<String>, FirewallError> {
        let output = self.command(args)?;
        match output.status.code() {
            Some(0) => Ok(Some(String::from_utf8_lossy(&output.stdout).into_owned())),
            Some(1) => Ok(None),
            _ => Err(self.failed(args, &output.stderr)),
        }
    }

    fn command(&self, args: &[&str]) -> Result<std::process::Output, FirewallError> {
        Command::new(&self.iptables)
            // Waits for the xtables lock instead of failing when Docker holds it.
            .arg("-w")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| FirewallError::Spawn {
                program: self.iptables.display().to_string(),
                source,
            })
    }

    fn restore(&self, script: &str) -> Result<(), FirewallError> {
        let program = self.restore.display().to_string();
        let spawn = |source| FirewallError::Spawn {
            program: program.clone(),
            source,
        };
        let mut child = Command::new(&self.restore)
            .args(["-w", "--noflush"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn)?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(script.as_bytes()).map_err(spawn)?;
        }
        let output = child.wait_with_output().map_err(spawn)?;
        if output.status.success() {
            Ok(())
        } else {
            Err(FirewallError::Failed {
                program,
                args: "-w --noflush".to_owned(),
                stderr: stderr_text(&output.stderr),
            })
        }
    }

    fn failed(&self, args: &[&str], stderr: &[u8]) -> FirewallError {
        FirewallError::Failed {
            program: self.iptables.display().to_string(),
            args: args.join(" "),
            stderr: stderr_text(stderr),
        }
    }
}

/// iptables' complaint without the nf_tables backend's warning about legacy tables.
fn stderr_text(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|line| !line.starts_with("# Warning:"))
        .collect::<Vec<_>>()
        .join("; ")
}

impl HostFirewall for Iptables {
    fn ensure(&self) -> BoxFuture<'_, Result<FirewallState, FirewallError>> {
        self.off_thread("the check", Self::ensure_blocking)
    }

    fn remove(&self) -> BoxFuture<'_, Result<(), FirewallError>> {
        self.off_thread("the removal", Self::remove_blocking)
    }
}

impl Iptables {
    /// Runs `work` (a few short iptables runs) on a blocking thread; `what` names it when the
    /// thread fails.
    fn off_thread<T: Send + 'static>(
        &self,
        what: &'static str,
        work: fn(&Self) -> Result<T, FirewallError>,
    ) -> BoxFuture<'static, Result<T, FirewallError>> {
        let this = self.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || work(&this))
                .await
                .unwrap_or_else(|e| {
                    Err(FirewallError::Mismatch(format!(
                        "{what} did not finish: {e}"
                    )))
                })
        })
    }
}
