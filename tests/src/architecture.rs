//! The architecture's invariants, checked on the source text of the workspace (nothing is built,
//! no Docker): every `.rs` file under each member crate's `src/` is parsed with `syn`, the
//! module tree is followed from each crate root (`mod x;`, `#[path]`), and every name a file
//! takes from its crate — `use` items, `crate::`/`super::`/`self::` paths, paths through a
//! name it imported or a child module, also inside macro calls and attributes — is resolved to
//! the file that defines it, through re-exports. That gives each crate's file-level import
//! graph, and the tests assert:
//!
//! - (a) no import cycle between the files of any crate ([`no_import_cycles`]). Two kinds of
//!   reference do not close a cycle: test code (under `#[cfg(test)]`: a test may use what it
//!   exercises, and fixtures from anywhere), and a module's file using one of its own
//!   submodules' files (it declares them, and re-exports or routes to them: that points
//!   downward, and the submodule's `super::` use of it is what the module is for);
//! - (a') no import cycle between the top-level modules of any crate, a folder with all its
//!   files counted as one module and the crate root as another ([`no_cycles_between_modules`]):
//!   a module's files may import each other, but two modules never both import from each
//!   other, and no module takes a name from the crate root that declares it;
//! - (b) session-manager's `src/domain/` is pure: it imports nothing of `crate::store`,
//!   `crate::api` or `crate::dashboard`, and uses neither tokio, sqlx, axum, reqwest nor
//!   `std::fs`/`std::net` ([`domain_is_pure`]);
//! - (c) session-manager's `src/api/` never imports `crate::dashboard`, and `src/dashboard/`
//!   never imports `crate::api` ([`api_and_dashboard_stay_apart`]);
//! - (d) session-manager's `src/store/` imports nothing of its crate but the lower modules in
//!   [`STORE_MAY_IMPORT`] ([`store_imports_only_lower_modules`]);
//! - (e) only `node-agent/src/runtime/docker.rs` uses bollard, anywhere in the workspace
//!   ([`only_the_docker_runtime_uses_bollard`]);
//! - (f) only `session-manager/src/store/` uses sqlx, anywhere in the workspace
//!   ([`only_the_store_uses_sqlx`]), but for the two tests that write an earlier release's
//!   database by hand ([`SQLX_OLD_SCHEMA_TESTS`]);
//! - (g) session-manager's transports wake nobody: no code of `src/api/` or `src/dashboard/`
//!   calls a wake-up ([`WAKE_UPS`]: the change notifications, the scheduler's and the grid
//!   mirror's wake-ups, `AppState::committed`); a use case of `app/` says what its write changed
//!   ([`transports_wake_nobody`]);
//! - (h) nor do they touch the store: no code of `src/api/` or `src/dashboard/` reaches
//!   `AppState::store`; every read and write goes through a use case or read model of `app/`
//!   ([`transports_go_through_the_application`]).
//!
//! "Anywhere in the workspace" is every `.rs` file of the repository outside `target/` and
//! hidden directories: sources, tests, benches, examples, build scripts, fuzz targets. A path
//! counts where it is written and also where a crate-internal path reaches an outside crate
//! through a re-export (`crate::store::Pool` re-exporting `sqlx::Pool` counts as sqlx).
//!
//! Each test prints every violation it finds, with the file, the path as written and the file
//! it resolves to. Doc comments are not imports and are not read.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;

use proc_macro2::{Delimiter, Spacing, TokenStream, TokenTree};
use syn::visit::{self, Visit};

/// The only modules of session-manager's crate that `src/store/` may import: the domain it
/// stores and itself. (Today it imports exactly these.)
const STORE_MAY_IMPORT: &[&str] = &["domain", "store"];

/// The only file of the workspace that may use bollard.
const BOLLARD_FILE: &str = "node-agent/src/runtime/docker.rs";

/// Where sqlx may be used: the store of session-manager.
const SQLX_DIR: &str = "session-manager/src/store/";

/// The tests that make a database of an earlier release by hand (its migrations, then rows
/// written with raw SQL) to show the store opens it and loses nothing: no store method can
/// write an old schema, since the store always migrates to the latest. They use sqlx on a
/// database of their own, never the product's path to one.
const SQLX_OLD_SCHEMA_TESTS: [&str; 2] = [
    "session-manager/src/hold_timer.rs",
    "session-manager/tests/api/upgrade.rs",
];

/// What session-manager's domain may not use from outside the crate: `(crate, module)`, `None`
/// for the whole crate.
const DOMAIN_MAY_NOT_USE: &[(&str, Option<&str>)] = &[
    ("tokio", None),
    ("sqlx", None),
    ("axum", None),
    ("reqwest", None),
    ("std", Some("fs")),
    ("std", Some("net")),
];

/// The calls that wake waiters, as `(receiver, method)` (`None`: any receiver), which only the
/// application layer and the manager's loops make: the change notifications
/// (`crate::notify::Changes`), the scheduling loop's and the grid mirror's wake-ups, and
/// `AppState::committed`, through which a use case says what it changed.
const WAKE_UPS: &[(Option<&str>, &str)] = &[
    (Some("changes"), "site"),
    (Some("changes"), "sessions"),
    (Some("changes"), "node"),
    (Some("changes"), "node_or_site"),
    (Some("wake"), "notify_one"),
    (Some("wake"), "notify_waiters"),
    (Some("grid"), "wake"),
    (None, "committed"),
];

/// What session-manager's domain may not import from its own crate.
const DOMAIN_MAY_NOT_IMPORT: &[&str] = &["store", "api", "dashboard"];

#[test]
fn no_import_cycles() {
    let report = cycles_report("files", CrateSource::cycles);
    assert!(
        report.is_empty(),
        "import cycles between files (move the shared names into a lower module, or into the \
         module that uses them):\n{report}"
    );
}

#[test]
fn no_cycles_between_modules() {
    let report = cycles_report("modules", CrateSource::module_cycles);
    assert!(
        report.is_empty(),
        "import cycles between modules, each folder counted as one (move the shared names into \
         a module below both, or into the one that uses them):\n{report}"
    );
}

/// Every cycle `cycles` finds in each crate of the workspace, with the edges that make it, one
/// line each; empty when there is none.
fn cycles_report(what: &str, cycles: fn(&CrateSource) -> Vec<Cycle>) -> String {
    let mut report = String::new();
    for krate in &workspace().crates {
        for cycle in cycles(krate) {
            let _ = writeln!(
                report,
                "{}: a cycle of {} {what}: {}",
                krate.dir,
                cycle.files.len(),
                cycle
                    .files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            for ((from, to), names) in &cycle.edges {
                let _ = writeln!(
                    report,
                    "  {} -> {}: {}",
                    from.display(),
                    to.display(),
                    names.iter().cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
    }
    report
}

#[test]
fn domain_is_pure() {
    let manager = workspace().krate("session-manager");
    let mut violations = BTreeSet::new();
    for reference in manager.references_from("domain") {
        for top in reference.crate_modules(&manager.src) {
            if DOMAIN_MAY_NOT_IMPORT.contains(&top.as_str()) {
                violations.insert(format!("{} (crate::{top})", reference.describe()));
            }
        }
        if let Some(rule) = reference.external.as_deref().and_then(domain_forbids) {
            violations.insert(format!("{} ({rule})", reference.describe()));
        }
    }
    // Written paths anywhere in the domain's files, also those the module tree does not reach.
    for (file, paths) in &workspace().written {
        if !file.starts_with(manager.src.join("domain")) {
            continue;
        }
        for path in paths {
            if let Some(rule) = domain_forbids(&external_path(path)) {
                violations.insert(format!(
                    "{} uses {} ({rule})",
                    file.display(),
                    path.join("::")
                ));
            }
        }
    }
    assert_none(
        "session-manager's domain must be pure: no store, API, dashboard, tokio, sqlx, axum, \
         reqwest, std::fs or std::net",
        &violations,
    );
}

#[test]
fn api_and_dashboard_stay_apart() {
    let manager = workspace().krate("session-manager");
    let mut violations = BTreeSet::new();
    for (from, forbidden) in [("api", "dashboard"), ("dashboard", "api")] {
        for reference in manager.references_from(from) {
            if reference
                .crate_modules(&manager.src)
                .iter()
                .any(|top| top == forbidden)
            {
                violations.insert(format!(
                    "{} (src/{from}/ imports crate::{forbidden})",
                    reference.describe()
                ));
            }
        }
    }
    assert_none(
        "session-manager's api/ and dashboard/ must not import each other (what both need \
         belongs below them)",
        &violations,
    );
}

#[test]
fn transports_wake_nobody() {
    let mut violations = BTreeSet::new();
    for (file, calls) in transport_calls() {
        for call in calls.found {
            violations.insert(format!("{}: {call}", file.display()));
        }
    }
    assert_none(
        "session-manager's api/ and dashboard/ must wake nobody: the use case in app/ says what \
         its write changed (app::Effect, AppState::committed)",
        &violations,
    );
}

#[test]
fn transports_go_through_the_application() {
    let mut violations = BTreeSet::new();
    for (file, calls) in transport_calls() {
        for within in calls.store_uses {
            violations.insert(format!("{}: {within}() uses the store", file.display()));
        }
    }
    assert_none(
        "session-manager's api/ and dashboard/ must not touch the store: a use case or read \
         model of app/ reads and writes it",
        &violations,
    );
}

/// The wake-up calls and store uses of each file of session-manager's `src/api/` and
/// `src/dashboard/`.
fn transport_calls() -> Vec<(PathBuf, WakeUpCalls)> {
    let manager = workspace().krate("session-manager");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the workspace");
    let mut found = Vec::new();
    for dir in ["api", "dashboard"] {
        for file in rust_files(&root.join(&manager.src).join(dir)) {
            let syntax = parse(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let mut calls = WakeUpCalls::default();
            calls.visit_file(&syntax);
            found.push((file, calls));
        }
    }
    found
}

/// The [`WAKE_UPS`] calls and the store uses of a file outside its test code, with the
/// function making each.
#[derive(Default)]
struct WakeUpCalls {
    /// The function (or method) being read.
    within: String,
    found: Vec<String>,
    /// The functions that reach a field named `store` (`AppState::store`).
    store_uses: BTreeSet<String>,
}

impl<'ast> Visit<'ast> for WakeUpCalls {
    fn visit_item_mod(&mut self, module: &'ast syn::ItemMod) {
        if !module.attrs.iter().any(is_cfg_test) {
            visit::visit_item_mod(self, module);
        }
    }

    fn visit_item_fn(&mut self, function: &'ast syn::ItemFn) {
        if !function.attrs.iter().any(is_cfg_test) {
            self.within = function.sig.ident.to_string();
            visit::visit_item_fn(self, function);
        }
    }

    fn visit_impl_item_fn(&mut self, function: &'ast syn::ImplItemFn) {
        self.within = function.sig.ident.to_string();
        visit::visit_impl_item_fn(self, function);
    }

    fn visit_expr_field(&mut self, field: &'ast syn::ExprField) {
        if matches!(&field.member, syn::Member::Named(name) if name == "store") {
            self.store_uses.insert(self.within.clone());
        }
        visit::visit_expr_field(self, field);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        let method = call.method.to_string();
        let receiver = match &*call.receiver {
            syn::Expr::Field(field) => match &field.member {
                syn::Member::Named(name) => Some(name.to_string()),
                syn::Member::Unnamed(_) => None,
            },
            syn::Expr::Path(path) => path.path.get_ident().map(ToString::to_string),
            _ => None,
        };
        let wakes = WAKE_UPS.iter().any(|(on, name)| {
            *name == method && on.is_none_or(|on| receiver.as_deref() == Some(on))
        });
        if wakes {
            let on = receiver.unwrap_or_else(|| "…".to_owned());
            self.found
                .push(format!("{}() calls {on}.{method}(…)", self.within));
        }
        visit::visit_expr_method_call(self, call);
    }
}

#[test]
fn store_imports_only_lower_modules() {
    let manager = workspace().krate("session-manager");
    let mut violations = BTreeSet::new();
    for reference in manager.references_from("store") {
        for top in reference.crate_modules(&manager.src) {
            if !STORE_MAY_IMPORT.contains(&top.as_str()) {
                let what = if top.is_empty() {
                    "the crate root (lib.rs)".to_owned()
                } else {
                    format!("crate::{top}")
                };
                violations.insert(format!("{} ({what})", reference.describe()));
            }
        }
    }
    assert_none(
        &format!(
            "session-manager's store/ may import only {} of its crate",
            STORE_MAY_IMPORT
                .iter()
                .map(|m| format!("crate::{m}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        &violations,
    );
}

#[test]
fn only_the_docker_runtime_uses_bollard() {
    let violations = users_of("bollard", |file| file == Path::new(BOLLARD_FILE));
    assert_none(
        &format!("only {BOLLARD_FILE} may use bollard (the ContainerRuntime trait hides it)"),
        &violations,
    );
}

#[test]
fn only_the_store_uses_sqlx() {
    let violations = users_of("sqlx", |file| {
        file.starts_with(SQLX_DIR)
            || SQLX_OLD_SCHEMA_TESTS
                .iter()
                .any(|test| file == Path::new(test))
    });
    assert_none(
        &format!("only {SQLX_DIR} may use sqlx (SQL lives in the store)"),
        &violations,
    );
}

fn assert_none(rule: &str, violations: &BTreeSet<String>) {
    assert!(
        violations.is_empty(),
        "{rule}; {} violations:\n{}",
        violations.len(),
        violations.iter().cloned().collect::<Vec<_>>().join("\n")
    );
}

/// Which rule of the domain's `external` path breaks, if any.
fn domain_forbids(external: &[String]) -> Option<String> {
    let first = external.first()?;
    DOMAIN_MAY_NOT_USE.iter().find_map(|(krate, module)| {
        let hit = first == krate && module.is_none_or(|m| external.get(1).is_some_and(|s| s == m));
        hit.then(|| match module {
            Some(m) => format!("{krate}::{m}"),
            None => (*krate).to_owned(),
        })
    })
}

/// Every use of crate `name` outside the files `allowed` accepts: as written anywhere in the
/// workspace, and through re-exports in the crates' module trees.
fn users_of(name: &str, allowed: impl Fn(&Path) -> bool) -> BTreeSet<String> {
    let workspace = workspace();
    let mut violations = BTreeSet::new();
    for (file, paths) in &workspace.written {
        if allowed(file) {
            continue;
        }
        for path in paths {
            if external_path(path)
                .first()
                .is_some_and(|first| first == name)
            {
                violations.insert(format!("{} uses {}", file.display(), path.join("::")));
            }
        }
    }
    for krate in &workspace.crates {
        for reference in &krate.references {
            if allowed(&reference.from) {
                continue;
            }
            if reference
                .external
                .iter()
                .any(|path| path.first().is_some_and(|first| first == name))
            {
                violations.insert(reference.describe());
            }
        }
    }
    violations
}

/// A path written as an outside crate's, without a leading `::`.
fn external_path(path: &[String]) -> Vec<String> {
    match path.first() {
        Some(first) if first == "::" => path[1..].to_vec(),
        _ => path.to_vec(),
    }
}

/// The workspace, read once for all tests (on a thread with room for `syn`'s recursion over
/// deeply nested expressions).
fn workspace() -> &'static Workspace {
    static WORKSPACE: OnceLock<Workspace> = OnceLock::new();
    WORKSPACE.get_or_init(|| {
        std::thread::Builder::new()
            .name("read the workspace".to_owned())
            .stack_size(256 * 1024 * 1024)
            .spawn(Workspace::read)
            .expect("a thread to read the workspace")
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

struct Workspace {
    crates: Vec<CrateSource>,
    /// Every path written in every `.rs` file of the repository (relative paths).
    written: BTreeMap<PathBuf, Vec<Vec<String>>>,
}

impl Workspace {
    fn read() -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the tests crate is in the workspace")
            .to_path_buf();
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
        let manifest: toml::Table = manifest.parse().expect("Cargo.toml is TOML");
        let members = manifest["workspace"]["members"]
            .as_array()
            .expect("workspace.members is a list");
        let mut problems = Vec::new();
        let crates = members
            .iter()
            .map(|member| {
                let dir = member.as_str().expect("a member is a path");
                CrateSource::read(&root, dir, &mut problems)
            })
            .collect();
        let mut written = BTreeMap::new();
        for file in rust_files(&root) {
            let relative = file
                .strip_prefix(&root)
                .expect("under the root")
                .to_path_buf();
            match parse(&file) {
                Ok(ast) => {
                    let mut scan = PathScan::default();
                    scan.visit_file(&ast);
                    written.insert(relative, scan.paths);
                }
                Err(error) => problems.push(format!("{}: {error}", relative.display())),
            }
        }
        assert!(
            problems.is_empty(),
            "the sources could not all be read:\n{}",
            problems.join("\n")
        );
        Self { crates, written }
    }

    fn krate(&self, dir: &str) -> &CrateSource {
        self.crates
            .iter()
            .find(|c| c.dir == dir)
            .unwrap_or_else(|| panic!("no workspace member {dir}"))
    }
}

fn parse(file: &Path) -> Result<syn::File, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("cannot read: {e}"))?;
    syn::parse_file(&text).map_err(|e| format!("does not parse: {e}"))
}

/// Every `.rs` file under `dir`, leaving out `target/` and hidden directories.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name.starts_with('.') || name == "target" {
                continue;
            }
            files.extend(rust_files(&path));
        } else if name.ends_with(".rs") {
            files.push(path);
        }
    }
    files
}

/// One member crate: its module trees (one per crate root under `src/`) read into references.
struct CrateSource {
    /// The member's directory, as in `workspace.members`.
    dir: String,
    /// `<dir>/src`, relative to the workspace root.
    src: PathBuf,
    references: Vec<Reference>,
}

/// One name a file takes from its crate (or from outside it).
struct Reference {
    /// The file it is written in, relative to the workspace root.
    from: PathBuf,
    /// As written, `::`-joined.
    written: String,
    /// The top-level module of the crate it is written through (`""`: the crate root), when
    /// it starts with `crate`, `super` or `self`.
    written_top: Option<String>,
    /// The file that defines the name it resolves to, and the name.
    target: Option<(PathBuf, String)>,
    /// Written in test code (under `#[cfg(test)]`).
    test: bool,
    /// It goes from a module's file down to a file of one of the module's own submodules.
    contained: bool,
    /// The outside crate's path it reaches through a re-export in another file (a path of an
    /// outside crate written in the file itself is in [`Workspace::written`]).
    external: Option<Vec<String>>,
}

impl Reference {
    /// The top-level modules of the crate this reference goes to: the one it is written
    /// through and the one of the file that defines it (`""` for the crate root).
    fn crate_modules(&self, src: &Path) -> BTreeSet<String> {
        let mut tops = BTreeSet::new();
        if let Some(top) = &self.written_top {
            tops.insert(top.clone());
        }
        if let Some((file, _)) = &self.target {
            tops.insert(top_module(src, file));
        }
        tops
    }

    fn describe(&self) -> String {
        let mut text = format!("{} imports {}", self.from.display(), self.written);
        if let Some((file, name)) = &self.target {
            let _ = write!(text, " ({name} in {})", file.display());
        }
        if let Some(external) = &self.external {
            if external.join("::") != self.written {
                let _ = write!(text, " (re-exported {})", external.join("::"));
            }
        }
        text
    }
}

/// `store` for `<src>/store/sql/jobs.rs`, `scheduler` for `<src>/scheduler.rs`, `""` for the
/// crate roots.
fn top_module(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).unwrap_or(file);
    let mut components = relative.components();
    let first = components
        .next()
        .and_then(|c| c.as_os_str().to_str())
        .unwrap_or("");
    let more = components.next().is_some();
    match first.strip_suffix(".rs") {
        Some("lib" | "main") if !more => String::new(),
        Some(module) => module.to_owned(),
        None => first.to_owned(),
    }
}

struct Cycle {
    files: BTreeSet<PathBuf>,
    edges: Edges,
}

impl CrateSource {
    fn read(root: &Path, dir: &str, problems: &mut Vec<String>) -> Self {
        let src = Path::new(dir).join("src");
        let mut roots = Vec::new();
        for name in ["lib.rs", "main.rs"] {
            if root.join(&src).join(name).is_file() {
                roots.push(src.join(name));
            }
        }
        let bin = root.join(&src).join("bin");
        if bin.is_dir() {
            for file in rust_files(&bin) {
                let relative = file.strip_prefix(root).expect("under the root");
                let is_bin_root = file.parent() == Some(bin.as_path())
                    || file.file_name().is_some_and(|n| n == "main.rs");
                if is_bin_root {
                    roots.push(relative.to_path_buf());
                }
            }
        }
        let mut references = Vec::new();
        let mut reached = BTreeSet::new();
        for crate_root in roots {
            let tree = Tree::read(root, &crate_root, problems);
            reached.extend(tree.modules.iter().map(|m| m.file.clone()));
            references.extend(tree.references());
        }
        for file in rust_files(&root.join(&src)) {
            let relative = file
                .strip_prefix(root)
                .expect("under the root")
                .to_path_buf();
            if !reached.contains(&relative) {
                problems.push(format!(
                    "{}: no module of its crate declares it (remove it, or declare it with \
                     `mod`)",
                    relative.display()
                ));
            }
        }
        Self {
            dir: dir.to_owned(),
            src,
            references,
        }
    }

    /// The references written in the files under `<src>/<top>/` (or `<src>/<top>.rs`).
    fn references_from<'a>(&'a self, top: &'a str) -> impl Iterator<Item = &'a Reference> {
        self.references
            .iter()
            .filter(move |r| top_module(&self.src, &r.from) == top)
    }

    /// The import graph's strongly connected components of more than one file.
    fn cycles(&self) -> Vec<Cycle> {
        let mut edges: Edges = BTreeMap::new();
        for reference in &self.references {
            if reference.test || reference.contained {
                continue;
            }
            if let Some((to, name)) = &reference.target {
                if *to != reference.from {
                    edges
                        .entry((reference.from.clone(), to.clone()))
                        .or_default()
                        .insert(name.clone());
                }
            }
        }
        cycles_of(&edges)
    }

    /// The cycles between the crate's top-level modules (a folder with its files is one:
    /// `store/`; the crate root is `(crate root)`), each edge with the files and names that
    /// make it. The crate root's own uses of its modules count here: a module that takes a
    /// name from the crate root is in a cycle with it.
    fn module_cycles(&self) -> Vec<Cycle> {
        let label = |file: &Path| match top_module(&self.src, file) {
            top if top.is_empty() => PathBuf::from("(crate root)"),
            top => PathBuf::from(top),
        };
        let mut edges: Edges = BTreeMap::new();
        for reference in &self.references {
            if reference.test {
                continue;
            }
            if let Some((to, name)) = &reference.target {
                let (from_module, to_module) = (label(&reference.from), label(to));
                if from_module != to_module {
                    edges
                        .entry((from_module, to_module))
                        .or_default()
                        .insert(format!("{} takes {name}", reference.from.display()));
                }
            }
        }
        cycles_of(&edges)
    }
}

/// Import edges `(from, to)`, each with the names that make it.
type Edges = BTreeMap<(PathBuf, PathBuf), BTreeSet<String>>;

/// The strongly connected components of more than one node of `edges`, with their edges.
fn cycles_of(edges: &Edges) -> Vec<Cycle> {
    let mut next: BTreeMap<&PathBuf, Vec<&PathBuf>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        next.entry(from).or_default().push(to);
        next.entry(to).or_default();
    }
    strongly_connected(&next)
        .into_iter()
        .filter(|component| component.len() > 1)
        .map(|component| {
            let files: BTreeSet<PathBuf> = component.into_iter().cloned().collect();
            let edges = edges
                .iter()
                .filter(|((from, to), _)| files.contains(from) && files.contains(to))
                .map(|(edge, names)| (edge.clone(), names.clone()))
                .collect();
            Cycle { files, edges }
        })
        .collect()
}

/// Tarjan's algorithm, iterative.
fn strongly_connected<'a>(next: &BTreeMap<&'a PathBuf, Vec<&'a PathBuf>>) -> Vec<Vec<&'a PathBuf>> {
    let nodes: Vec<&PathBuf> = next.keys().copied().collect();
    let index_of: BTreeMap<&PathBuf, usize> =
        nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let successors: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| next[n].iter().map(|m| index_of[m]).collect())
        .collect();
    let mut index = vec![usize::MAX; nodes.len()];
    let mut low = vec![0; nodes.len()];
    let mut on_stack = vec![false; nodes.len()];
    let mut stack = Vec::new();
    let mut components = Vec::new();
    let mut counter = 0;
    for start in 0..nodes.len() {
        if index[start] != usize::MAX {
            continue;
        }
        // (node, position in its successors)
        let mut work = vec![(start, 0)];
        index[start] = counter;
        low[start] = counter;
        counter += 1;
        stack.push(start);
        on_stack[start] = true;
        while let Some(&(node, position)) = work.last() {
            if let Some(&successor) = successors[node].get(position) {
                if let Some(top) = work.last_mut() {
                    top.1 += 1;
                }
                if index[successor] == usize::MAX {
                    index[successor] = counter;
                    low[successor] = counter;
                    counter += 1;
                    stack.push(successor);
                    on_stack[successor] = true;
                    work.push((successor, 0));
                } else if on_stack[successor] {
                    low[node] = low[node].min(index[successor]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[node]);
            }
            if low[node] == index[node] {
                let mut component = Vec::new();
                while let Some(member) = stack.pop() {
                    on_stack[member] = false;
                    component.push(nodes[member]);
                    if member == node {
                        break;
                    }
                }
                components.push(component);
            }
        }
    }
    components
}

/// One module of a crate's tree: a file, or an inline `mod name { ... }` in one.
#[derive(Default)]
struct Module {
    /// From the crate root: `["store", "sqlite", "sql"]`.
    path: Vec<String>,
    /// The file it is written in, relative to the workspace root.
    file: PathBuf,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    /// The names its items define (types, functions, constants, traits, macros, ...).
    items: BTreeSet<String>,
    /// The names its `use` items bring in: name → path as written.
    bindings: BTreeMap<String, Vec<String>>,
    /// The paths of its glob imports (`use path::*`).
    globs: Vec<Vec<String>>,
    /// Every path written in it that may name something of the crate: the leaves of its `use`
    /// items, paths of two or more segments, paths starting with `crate`, `super` or `self`;
    /// and whether it is written in test code (under `#[cfg(test)]`).
    paths: Vec<(Vec<String>, bool)>,
    /// Single names written in it, which may come through a glob import (and whether in test
    /// code).
    names: Vec<(String, bool)>,
}

struct Tree {
    modules: Vec<Module>,
}

/// What a path resolves to.
enum Resolved {
    /// A module of the crate.
    Module(usize),
    /// A name defined in a module of the crate (or one not found there: generated by a macro,
    /// or under a `cfg`; it is taken for the module's).
    Item(usize, String),
    /// A path of an outside crate, and the module whose `use` brought it in.
    External(Vec<String>, usize),
}

/// How deep re-exports and globs are followed.
const MAX_DEPTH: usize = 12;

impl Tree {
    fn read(root: &Path, crate_root: &Path, problems: &mut Vec<String>) -> Self {
        let mut tree = Tree {
            modules: vec![Module {
                file: crate_root.to_path_buf(),
                ..Module::default()
            }],
        };
        let ast = match parse(&root.join(crate_root)) {
            Ok(ast) => ast,
            Err(error) => {
                problems.push(format!("{}: {error}", crate_root.display()));
                return tree;
            }
        };
        let dir = crate_root
            .parent()
            .expect("a root has a directory")
            .to_path_buf();
        let mut collector = Collector {
            root,
            tree: &mut tree,
            module: 0,
            child_dir: dir,
            inline: false,
            test: false,
            problems,
        };
        collector.enter(&ast.items);
        collector.visit_file(&ast);
        tree
    }

    fn references(&self) -> Vec<Reference> {
        let mut references = Vec::new();
        for (index, module) in self.modules.iter().enumerate() {
            for (path, test) in &module.paths {
                let mut reference = self.reference(index, path);
                reference.test = *test;
                references.push(reference);
            }
            // A single name is a local one (a variable, a generic, an item of the module, an
            // imported name whose `use` is already a reference), unless a glob brought it in.
            for (name, test) in &module.names {
                let own = module.items.contains(name)
                    || module.bindings.contains_key(name)
                    || module.children.contains_key(name);
                if !own && self.through_globs(index, name, 0).is_some() {
                    let mut reference = self.reference(index, std::slice::from_ref(name));
                    reference.test = *test;
                    references.push(reference);
                }
            }
        }
        references
    }

    fn reference(&self, module: usize, path: &[String]) -> Reference {
        let mut reference = Reference {
            from: self.modules[module].file.clone(),
            written: path.join("::"),
            written_top: None,
            target: None,
            test: false,
            contained: false,
            external: None,
        };
        let Some((start, rest)) = self.start(module, path, None, 0) else {
            return reference;
        };
        if matches!(path[0].as_str(), "crate" | "$crate" | "super" | "self") {
            let mut absolute = self.modules[start].path.iter().chain(rest);
            let top = absolute
                .next()
                .filter(|first| self.modules[0].children.contains_key(*first))
                .cloned()
                .unwrap_or_default();
            reference.written_top = Some(top);
        }
        let last = path.last().cloned().unwrap_or_default();
        if let Some(resolved) = self.resolve(start, rest, 0, false) {
            self.fill(&mut reference, resolved, &last);
        }
        reference
    }

    fn fill(&self, reference: &mut Reference, resolved: Resolved, last: &str) {
        match resolved {
            Resolved::Module(m) => {
                let module = &self.modules[m];
                let name = module
                    .path
                    .last()
                    .cloned()
                    .unwrap_or_else(|| last.to_owned());
                reference.target = Some((module.file.clone(), name));
                reference.contained = self.contains(&reference.from, m);
            }
            Resolved::Item(m, name) => {
                reference.target = Some((self.modules[m].file.clone(), name));
                reference.contained = self.contains(&reference.from, m);
            }
            Resolved::External(path, via) => {
                if self.modules[via].file != reference.from {
                    reference.external = Some(path);
                }
            }
        }
    }

    /// Whether module `target` is a submodule, in another file, of a module written in `file`.
    fn contains(&self, file: &Path, target: usize) -> bool {
        let target = &self.modules[target];
        target.file != file
            && self.modules.iter().any(|m| {
                m.file == file
                    && target.path.len() > m.path.len()
                    && target.path.starts_with(&m.path)
            })
    }

    /// Where `path`, written in `module`, starts in the crate, and what is left of it; `None`
    /// for a path of an outside crate. `binding` is the name whose `use` the path is, which
    /// cannot name itself (`use tokio;`).
    fn start<'p>(
        &self,
        module: usize,
        path: &'p [String],
        binding: Option<&str>,
        depth: usize,
    ) -> Option<(usize, &'p [String])> {
        if depth > MAX_DEPTH {
            return None;
        }
        let first = path.first()?;
        match first.as_str() {
            "::" => None,
            "crate" | "$crate" => Some((0, &path[1..])),
            "self" => Some((module, &path[1..])),
            "super" => {
                let mut at = module;
                let mut rest = path;
                while rest.first().is_some_and(|s| s == "super") {
                    at = self.modules[at].parent?;
                    rest = &rest[1..];
                }
                Some((at, rest))
            }
            name => {
                let m = &self.modules[module];
                let local = m.children.contains_key(name)
                    || m.items.contains(name)
                    || (m.bindings.contains_key(name) && binding != Some(name))
                    || self.through_globs(module, name, depth + 1).is_some();
                local.then_some((module, path))
            }
        }
    }

    /// What `path` names, looked up in `module`. Strict: only what is found (for globs).
    fn resolve(
        &self,
        module: usize,
        path: &[String],
        depth: usize,
        strict: bool,
    ) -> Option<Resolved> {
        if depth > MAX_DEPTH {
            return None;
        }
        let Some(first) = path.first() else {
            return Some(Resolved::Module(module));
        };
        let m = &self.modules[module];
        if let Some(&child) = m.children.get(first) {
            return self.resolve(child, &path[1..], depth + 1, false);
        }
        if let Some(target) = m.bindings.get(first) {
            let mut full = target.clone();
            full.extend(path[1..].iter().cloned());
            return match self.start(module, &full, Some(first), depth + 1) {
                None => Some(Resolved::External(external_path(&full), module)),
                Some((start, rest)) => self.resolve(start, rest, depth + 1, false),
            };
        }
        if m.items.contains(first) {
            return Some(Resolved::Item(module, first.clone()));
        }
        if let Some(found) = self.through_globs(module, first, depth + 1) {
            return match found {
                Resolved::Module(found) => self.resolve(found, &path[1..], depth + 1, false),
                other => Some(other),
            };
        }
        (!strict).then(|| Resolved::Item(module, first.clone()))
    }

    /// `name` as one of `module`'s glob imports brings it in.
    fn through_globs(&self, module: usize, name: &str, depth: usize) -> Option<Resolved> {
        if depth > MAX_DEPTH {
            return None;
        }
        for glob in &self.modules[module].globs {
            let Some((start, rest)) = self.start_without_globs(module, glob, depth + 1) else {
                continue;
            };
            let Some(Resolved::Module(base)) = self.resolve(start, rest, depth + 1, true) else {
                continue;
            };
            if base == module {
                continue;
            }
            let found = self.resolve(
                base,
                std::slice::from_ref(&name.to_owned()),
                depth + 1,
                true,
            );
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// [`Self::start`] for a glob's own path, which cannot come through a glob.
    fn start_without_globs<'p>(
        &self,
        module: usize,
        path: &'p [String],
        depth: usize,
    ) -> Option<(usize, &'p [String])> {
        let first = path.first()?;
        match first.as_str() {
            "::" => None,
            "crate" | "$crate" | "self" | "super" => self.start(module, path, None, depth),
            name => {
                let m = &self.modules[module];
                let local = m.children.contains_key(name)
                    || m.items.contains(name)
                    || m.bindings.contains_key(name);
                local.then_some((module, path))
            }
        }
    }
}

/// Reads one module's items into the tree, following `mod x;` into files.
struct Collector<'a> {
    root: &'a Path,
    tree: &'a mut Tree,
    module: usize,
    /// Where the files of this module's `mod x;` are (relative to the workspace root).
    child_dir: PathBuf,
    /// Inside an inline `mod name { ... }`.
    inline: bool,
    /// Inside an item under `#[cfg(test)]`.
    test: bool,
    problems: &'a mut Vec<String>,
}

impl Collector<'_> {
    /// Records the names the module's own items define.
    fn enter(&mut self, items: &[syn::Item]) {
        let module = &mut self.tree.modules[self.module];
        for item in items {
            let name = match item {
                syn::Item::Const(i) => Some(&i.ident),
                syn::Item::Enum(i) => Some(&i.ident),
                syn::Item::Fn(i) => Some(&i.sig.ident),
                syn::Item::Macro(i) => i.ident.as_ref(),
                syn::Item::Static(i) => Some(&i.ident),
                syn::Item::Struct(i) => Some(&i.ident),
                syn::Item::Trait(i) => Some(&i.ident),
                syn::Item::TraitAlias(i) => Some(&i.ident),
                syn::Item::Type(i) => Some(&i.ident),
                syn::Item::Union(i) => Some(&i.ident),
                _ => None,
            };
            if let Some(name) = name {
                module.items.insert(unraw(name));
            }
        }
    }

    fn add_child(&mut self, name: String, file: PathBuf) -> usize {
        let mut path = self.tree.modules[self.module].path.clone();
        path.push(name.clone());
        self.tree.modules.push(Module {
            path,
            file,
            parent: Some(self.module),
            ..Module::default()
        });
        let index = self.tree.modules.len() - 1;
        self.tree.modules[self.module].children.insert(name, index);
        index
    }

    /// A path written in code: one of two or more segments may name something of the crate;
    /// a single name may have come through a glob. A lone `crate`, `self` or `super` is a
    /// visibility (`pub(crate)`) or a receiver (`self.x`), not an import.
    fn record(&mut self, path: Vec<String>) {
        let test = self.test;
        let module = &mut self.tree.modules[self.module];
        match path.as_slice() {
            [] => {}
            [name] if matches!(name.as_str(), "crate" | "$crate" | "super" | "self" | "::") => {}
            [_] => module
                .names
                .extend(path.into_iter().map(|name| (name, test))),
            _ => module.paths.push((path, test)),
        }
    }

    /// The file of `mod name;` declared here with `attrs`.
    fn module_file(
        &self,
        name: &str,
        attrs: &[syn::Attribute],
    ) -> Result<(PathBuf, PathBuf), String> {
        let declared_in = &self.tree.modules[self.module].file;
        if let Some(path) = path_attribute(attrs) {
            let base = if self.inline {
                self.child_dir.clone()
            } else {
                declared_in
                    .parent()
                    .expect("a file has a directory")
                    .to_path_buf()
            };
            let file = normalize(&base.join(path));
            let dir = file.parent().expect("a file has a directory").to_path_buf();
            return Ok((file, dir));
        }
        let flat = self.child_dir.join(format!("{name}.rs"));
        if self.root.join(&flat).is_file() {
            return Ok((flat, self.child_dir.join(name)));
        }
        let nested = self.child_dir.join(name).join("mod.rs");
        if self.root.join(&nested).is_file() {
            return Ok((nested, self.child_dir.join(name)));
        }
        Err(format!(
            "{}: `mod {name};` has no file {} or {}",
            declared_in.display(),
            flat.display(),
            nested.display()
        ))
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let outer = self.test;
        self.test |= item_attrs(item).iter().any(is_cfg_test);
        visit::visit_item(self, item);
        self.test = outer;
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        for attr in &item.attrs {
            self.visit_attribute(attr);
        }
        let name = unraw(&item.ident);
        match &item.content {
            Some((_, items)) => {
                let file = self.tree.modules[self.module].file.clone();
                let child = self.add_child(name.clone(), file);
                let mut inner = Collector {
                    root: self.root,
                    tree: &mut *self.tree,
                    module: child,
                    child_dir: self.child_dir.join(&name),
                    inline: true,
                    test: self.test,
                    problems: &mut *self.problems,
                };
                inner.enter(items);
                for item in items {
                    inner.visit_item(item);
                }
            }
            None => {
                let (file, child_dir) = match self.module_file(&name, &item.attrs) {
                    Ok(found) => found,
                    Err(problem) => {
                        self.problems.push(problem);
                        return;
                    }
                };
                let ast = match parse(&self.root.join(&file)) {
                    Ok(ast) => ast,
                    Err(error) => {
                        self.problems.push(format!("{}: {error}", file.display()));
                        return;
                    }
                };
                let child = self.add_child(name, file);
                let mut inner = Collector {
                    root: self.root,
                    tree: &mut *self.tree,
                    module: child,
                    child_dir,
                    inline: false,
                    test: self.test,
                    problems: &mut *self.problems,
                };
                inner.enter(&ast.items);
                inner.visit_file(&ast);
            }
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        for attr in &item.attrs {
            self.visit_attribute(attr);
        }
        let mut prefix = Vec::new();
        if item.leading_colon.is_some() {
            prefix.push("::".to_owned());
        }
        let mut leaves = Vec::new();
        use_leaves(&item.tree, &mut prefix, &mut leaves);
        let test = self.test;
        let module = &mut self.tree.modules[self.module];
        for leaf in leaves {
            match leaf {
                UseLeaf::Name { path, name } => {
                    if let Some(name) = name {
                        module.bindings.insert(name, path.clone());
                    }
                    module.paths.push((path, test));
                }
                UseLeaf::Glob(path) => {
                    module.globs.push(path.clone());
                    module.paths.push((path, test));
                }
            }
        }
    }

    fn visit_item_extern_crate(&mut self, item: &'ast syn::ItemExternCrate) {
        let path = vec!["::".to_owned(), unraw(&item.ident)];
        let name = item
            .rename
            .as_ref()
            .map_or_else(|| unraw(&item.ident), |(_, rename)| unraw(rename));
        let test = self.test;
        let module = &mut self.tree.modules[self.module];
        if name != "_" {
            module.bindings.insert(name, path.clone());
        }
        module.paths.push((path, test));
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.record(path_segments(path));
        visit::visit_path(self, path);
    }

    /// `pub(in crate::a)` names where an item is visible, not what it imports.
    fn visit_vis_restricted(&mut self, _: &'ast syn::VisRestricted) {}

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        let mut found = Vec::new();
        token_paths(mac.tokens.clone(), &mut found);
        for path in found {
            self.record(path);
        }
    }

    fn visit_attribute(&mut self, attr: &'ast syn::Attribute) {
        let mut found = Vec::new();
        attribute_paths(attr, &mut found);
        for path in found {
            self.record(path);
        }
    }
}

/// Collects every path written in a file, without a module tree.
#[derive(Default)]
struct PathScan {
    paths: Vec<Vec<String>>,
}

impl<'ast> Visit<'ast> for PathScan {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        for attr in &item.attrs {
            self.visit_attribute(attr);
        }
        let mut prefix = Vec::new();
        if item.leading_colon.is_some() {
            prefix.push("::".to_owned());
        }
        let mut leaves = Vec::new();
        use_leaves(&item.tree, &mut prefix, &mut leaves);
        for leaf in leaves {
            match leaf {
                UseLeaf::Name { path, .. } | UseLeaf::Glob(path) => self.paths.push(path),
            }
        }
    }

    fn visit_item_extern_crate(&mut self, item: &'ast syn::ItemExternCrate) {
        self.paths.push(vec![unraw(&item.ident)]);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.paths.push(path_segments(path));
        visit::visit_path(self, path);
    }

    fn visit_vis_restricted(&mut self, _: &'ast syn::VisRestricted) {}

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        token_paths(mac.tokens.clone(), &mut self.paths);
    }

    fn visit_attribute(&mut self, attr: &'ast syn::Attribute) {
        attribute_paths(attr, &mut self.paths);
    }
}

enum UseLeaf {
    /// `use a::b;` (`name` `b`), `use a::b as c;` (`c`), `use a::b as _;` (none),
    /// `use a::{self};` (`a`).
    Name {
        path: Vec<String>,
        name: Option<String>,
    },
    Glob(Vec<String>),
}

fn use_leaves(tree: &syn::UseTree, prefix: &mut Vec<String>, leaves: &mut Vec<UseLeaf>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(unraw(&p.ident));
            use_leaves(&p.tree, prefix, leaves);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let name = unraw(&n.ident);
            if name == "self" {
                leaves.push(UseLeaf::Name {
                    path: prefix.clone(),
                    name: prefix.last().cloned(),
                });
            } else {
                let mut path = prefix.clone();
                path.push(name.clone());
                leaves.push(UseLeaf::Name {
                    path,
                    name: Some(name),
                });
            }
        }
        syn::UseTree::Rename(r) => {
            let name = unraw(&r.ident);
            let mut path = prefix.clone();
            if name != "self" {
                path.push(name);
            }
            let rename = unraw(&r.rename);
            leaves.push(UseLeaf::Name {
                path,
                name: (rename != "_").then_some(rename),
            });
        }
        syn::UseTree::Glob(_) => leaves.push(UseLeaf::Glob(prefix.clone())),
        syn::UseTree::Group(g) => {
            for item in &g.items {
                use_leaves(item, prefix, leaves);
            }
        }
    }
}

fn path_segments(path: &syn::Path) -> Vec<String> {
    let mut segments = Vec::with_capacity(path.segments.len() + 1);
    if path.leading_colon.is_some() {
        segments.push("::".to_owned());
    }
    segments.extend(path.segments.iter().map(|s| unraw(&s.ident)));
    segments
}

/// The paths of an attribute: its own (`tokio::test`), those in its arguments
/// (`derive(sqlx::FromRow)`), and serde's paths in strings (`with = "crate::x"`). Doc comments
/// are not read.
fn attribute_paths(attr: &syn::Attribute, out: &mut Vec<Vec<String>>) {
    if attr.path().is_ident("doc") {
        return;
    }
    out.push(path_segments(attr.path()));
    if let syn::Meta::List(list) = &attr.meta {
        token_paths(list.tokens.clone(), out);
        if attr.path().is_ident("serde") {
            string_paths(list.tokens.clone(), out);
        }
    }
}

/// Paths in strings of `tokens` (serde's `with = "..."`, `default = "..."`).
fn string_paths(tokens: TokenStream, out: &mut Vec<Vec<String>>) {
    for tree in tokens {
        match tree {
            TokenTree::Group(group) => string_paths(group.stream(), out),
            TokenTree::Literal(literal) => {
                let Ok(text) = syn::parse_str::<syn::LitStr>(&literal.to_string()) else {
                    continue;
                };
                if let Ok(path) = syn::parse_str::<syn::Path>(&text.value()) {
                    out.push(path_segments(&path));
                }
            }
            _ => {}
        }
    }
}

/// The paths in a macro's tokens: `a::b::c`, `::a::b`, `$crate::a`, and single `crate`,
/// `self`, `super`.
fn token_paths(tokens: TokenStream, out: &mut Vec<Vec<String>>) {
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    let mut at = 0;
    while at < trees.len() {
        if let TokenTree::Group(group) = &trees[at] {
            if group.delimiter() != Delimiter::None || !group.stream().is_empty() {
                token_paths(group.stream(), out);
            }
            at += 1;
            continue;
        }
        match read_token_path(&trees, at) {
            Some((path, next)) => {
                out.push(path);
                at = next;
            }
            None => at += 1,
        }
    }
}

fn is_path_sep(trees: &[TokenTree], at: usize) -> bool {
    matches!(
        (trees.get(at), trees.get(at + 1)),
        (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
            if a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':'
    )
}

fn read_token_path(trees: &[TokenTree], start: usize) -> Option<(Vec<String>, usize)> {
    let mut path = Vec::new();
    let mut at = start;
    if is_path_sep(trees, at) {
        path.push("::".to_owned());
        at += 2;
    } else if let (Some(TokenTree::Punct(dollar)), Some(TokenTree::Ident(ident))) =
        (trees.get(at), trees.get(at + 1))
    {
        if dollar.as_char() != '$' || ident != "crate" {
            return None;
        }
        path.push("$crate".to_owned());
        at += 2;
        if !is_path_sep(trees, at) {
            return Some((path, at));
        }
        at += 2;
    }
    while let Some(TokenTree::Ident(ident)) = trees.get(at) {
        path.push(unraw(ident));
        at += 1;
        if is_path_sep(trees, at) && matches!(trees.get(at + 2), Some(TokenTree::Ident(_))) {
            at += 2;
        } else {
            break;
        }
    }
    let idents = path.iter().filter(|s| *s != "::").count();
    (idents > 0).then_some((path, at))
}

fn unraw(ident: &impl ToString) -> String {
    let text = ident.to_string();
    match text.strip_prefix("r#") {
        Some(raw) => raw.to_owned(),
        None => text,
    }
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    match item {
        syn::Item::Const(i) => &i.attrs,
        syn::Item::Enum(i) => &i.attrs,
        syn::Item::ExternCrate(i) => &i.attrs,
        syn::Item::Fn(i) => &i.attrs,
        syn::Item::ForeignMod(i) => &i.attrs,
        syn::Item::Impl(i) => &i.attrs,
        syn::Item::Macro(i) => &i.attrs,
        syn::Item::Mod(i) => &i.attrs,
        syn::Item::Static(i) => &i.attrs,
        syn::Item::Struct(i) => &i.attrs,
        syn::Item::Trait(i) => &i.attrs,
        syn::Item::TraitAlias(i) => &i.attrs,
        syn::Item::Type(i) => &i.attrs,
        syn::Item::Union(i) => &i.attrs,
        syn::Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// `#[cfg(test)]`, also within `all(...)`; not `not(test)`.
fn is_cfg_test(attr: &syn::Attribute) -> bool {
    let syn::Meta::List(list) = &attr.meta else {
        return false;
    };
    if !list.path.is_ident("cfg") {
        return false;
    }
    let mut idents = Vec::new();
    flat_idents(list.tokens.clone(), &mut idents);
    idents.iter().any(|i| i == "test") && !idents.iter().any(|i| i == "not" || i == "any")
}

fn flat_idents(tokens: TokenStream, out: &mut Vec<String>) {
    for tree in tokens {
        match tree {
            TokenTree::Ident(ident) => out.push(ident.to_string()),
            TokenTree::Group(group) => flat_idents(group.stream(), out),
            _ => {}
        }
    }
}

/// The value of `#[path = "..."]`.
fn path_attribute(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find_map(|attr| match &attr.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

/// `a/b/../c` → `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}
