//! `kvgate-crdgen`: writes the CRDs generated from kvgate's Rust types into the workspace, or
//! with `--check` fails when a committed copy has drifted from the code.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser as _;

/// Writes kvgate's CRDs (and the test copies of the upstream CRDs it reads) from the Rust types.
#[derive(Debug, clap::Parser)]
#[command(name = "kvgate-crdgen", version, about)]
struct Args {
    /// The workspace root the files are written under (default: this crate's workspace).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))]
    root: PathBuf,
    /// Write nothing; exit 1 and name every file that differs from what the code generates.
    #[arg(long)]
    check: bool,
}

/// Why the generator failed.
#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Gen(#[from] kvgate_crdgen::GenError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{0} generated file(s) differ from the code; run `cargo run -p kvgate-crdgen` and commit"
    )]
    Drift(usize),
}

impl cli_support::ExitStatus for Error {}

fn run(args: &Args) -> Result<(), Error> {
    let mut drifted = 0;
    for doc in kvgate_crdgen::documents()? {
        let path = args.root.join(&doc.path);
        let current = std::fs::read_to_string(&path).ok();
        if current.as_deref() == Some(doc.text.as_str()) {
            continue;
        }
        if args.check {
            eprintln!("drifted: {}", doc.path);
            drifted += 1;
            continue;
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| Error::Io {
                path: dir.to_owned(),
                source,
            })?;
        }
        std::fs::write(&path, &doc.text).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        eprintln!("wrote {}", doc.path);
    }
    if drifted > 0 {
        return Err(Error::Drift(drifted));
    }
    Ok(())
}

fn main() -> ExitCode {
    cli_support::exit(run(&Args::parse()))
}
