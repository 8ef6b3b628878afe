//! `ongrid-manager --config FILE [--check-config]`: loads the config, opens the database, binds,
//! prints `listening on ADDR` on stdout, and serves until SIGINT or SIGTERM. Everything else is
//! in the library; the start-up and shutdown plumbing (error format, exit codes, logging to
//! stderr with `ONGRID_LOG`, signals) is [`ongrid_service::Binary`], as for the gateway and the
//! agent.
//!
//! `ongrid-manager copy-store --from FILE --to URL` copies a SQLite store into an empty
//! PostgreSQL database (`ongrid_manager::store::copy`) and exits; `ongrid-manager mark-restored
//! --database URL` raises a restored database's generation (`ongrid_core::store_identity`), so
//! clients refuse a manager left on the old one, and exits.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ongrid_manager::{Config, Manager};

/// mimalloc instead of glibc's malloc. Under the fleet (`tests/examples/fleet.rs`) glibc's
/// malloc and free, with the consolidation of its free lists, took about a fifth of the
/// manager's CPU; with mimalloc the manager spent a fifth less CPU over the run and the creates'
/// latency fell by about as much (README, Measurements).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The ongrid control plane: HTTPS API, store (SQLite or PostgreSQL) and scheduler.
#[derive(Debug, Parser)]
#[command(
    name = "ongrid-manager",
    version,
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true
)]
struct Args {
    /// The manager's TOML config file.
    #[arg(long, value_name = "FILE", required = true)]
    config: Option<PathBuf>,
    /// Validate the config and the files it names (certificates, CA directory, agent tokens),
    /// then exit: 0 when valid, 2 (with the error) otherwise.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Copy a SQLite store into an empty PostgreSQL database, all in one transaction, then exit
    /// (stop the manager first; point its `database` at the URL once the copy is done).
    CopyStore {
        /// The SQLite file (the config's `database`).
        #[arg(long, value_name = "FILE")]
        from: PathBuf,
        /// The PostgreSQL database, empty: postgres://USER@HOST/DATABASE.
        #[arg(long, value_name = "URL")]
        to: String,
    },
    /// Mark a database restored from a backup as the store's newest copy (its generation one
    /// up), then exit: run it after the restore, before starting the managers on it. Clients
    /// then refuse a manager left on the old database.
    MarkRestored {
        /// The restored database, as the config's `database` names it: postgres://USER@HOST/DATABASE,
        /// or a SQLite file.
        #[arg(long, value_name = "URL")]
        database: String,
        /// The generation to give it when the managers served one above the backup's (a backup
        /// older than the last copy or restore): at least this.
        #[arg(long, value_name = "N")]
        generation: Option<u64>,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.command {
        Some(Command::CopyStore { from, to }) => return copy_store(&from, &to),
        Some(Command::MarkRestored {
            database,
            generation,
        }) => return mark_restored(&database, generation),
        None => {}
    }
    let Some(config) = args.config else {
        // clap requires --config without a subcommand.
        return ExitCode::from(2);
    };
    ongrid_service::Binary::new("ongrid-manager", &config, args.check_config)
        // Everything the config names, without touching the database.
        .check(|config: &Config| {
            ongrid_manager::prepare(config.clone())?;
            Ok(())
        })
        .run(Config::load(&config), |config, shutdown| async move {
            let listen = config.listen;
            let manager = Manager::open(config).await?;
            let listener = ongrid_service::bind_and_announce(listen).await?;
            manager.serve(listener, shutdown).await
        })
}

/// A runtime for a subcommand, or its failure printed.
fn runtime(command: &str) -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => Some(runtime),
        Err(e) => {
            eprintln!("ongrid-manager: {command}: starting the runtime: {e}");
            None
        }
    }
}

fn mark_restored(database: &str, generation: Option<u64>) -> ExitCode {
    let database = match ongrid_manager::store::Database::parse(database) {
        Ok(database) => database,
        Err(e) => {
            eprintln!("ongrid-manager: mark-restored: --database {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(file) = database.sqlite_file() {
        if !file.is_file() {
            eprintln!(
                "ongrid-manager: mark-restored: {} does not exist: name the restored SQLite file",
                file.display()
            );
            return ExitCode::FAILURE;
        }
    }
    let Some(runtime) = runtime("mark-restored") else {
        return ExitCode::FAILURE;
    };
    let marked = runtime.block_on(async {
        let opened = database.open().await?;
        let marked = opened.shared().mark_restored(generation).await;
        opened.close().await;
        marked
    });
    match marked {
        Ok(identity) => {
            println!(
                "{database}: store {} is now at generation {}; start the managers on it                  (clients refuse a manager still on an older copy)",
                identity.id, identity.generation
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ongrid-manager: mark-restored: {database}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "postgres")]
fn copy_store(from: &std::path::Path, to: &str) -> ExitCode {
    let Some(runtime) = runtime("copy-store") else {
        return ExitCode::FAILURE;
    };
    match runtime.block_on(ongrid_manager::store::copy::sqlite_to_postgres(from, to)) {
        Ok(copied) => {
            for (table, rows) in &copied.tables {
                println!("{table}: {rows} rows");
            }
            println!(
                "copied {} into PostgreSQL as the store's generation {}; set the config's \
                 `database` to the URL and start the manager (clients refuse a manager still \
                 on the SQLite file)",
                from.display(),
                copied.generation
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ongrid-manager: copy-store: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "postgres"))]
fn copy_store(_from: &std::path::Path, _to: &str) -> ExitCode {
    eprintln!(
        "ongrid-manager: copy-store: this ongrid-manager was built without PostgreSQL; build it \
         with `cargo build -p ongrid-manager --features postgres`"
    );
    ExitCode::FAILURE
}
