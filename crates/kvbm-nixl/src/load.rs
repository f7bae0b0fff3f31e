//! Finding NIXL at run time.
//!
//! The `stub-api` bindings `dlopen` [`LIBRARY`] on their first call and abort
//! the process when it is missing. [`library`] opens it first, through the same search path
//! (`LD_LIBRARY_PATH`, the loader's cache), and checks every symbol the bindings resolve, so
//! callers learn whether NIXL is usable before any binding runs. The handle is kept for the life of the process: the
//! bindings' own `dlopen` then finds the library already loaded.
#![allow(unsafe_code)]

use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::LIBRARY;
use crate::symbols::SYMBOLS;

/// Why NIXL cannot be used on this node.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The C API library is missing or is not NIXL's.
    #[error(transparent)]
    Unavailable(#[from] ProbeError),
    /// NIXL loaded, but an agent or its backend could not be created.
    #[error("NIXL {step}: {source}")]
    Agent {
        /// What was being done.
        step: &'static str,
        /// NIXL's error.
        #[source]
        source: nixl_sys::NixlError,
    },
}

/// Why the C API library could not be opened (kept for the life of the process).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProbeError {
    /// The C API library could not be opened (absent from the library path, or one of its own
    /// libraries missing).
    #[error(
        "{LIBRARY} could not be loaded: install NIXL, or give the library's path or put its directory on LD_LIBRARY_PATH"
    )]
    Library(#[source] Arc<libloading::Error>),
    /// The library is there but is not NIXL's C API (a symbol is missing).
    #[error("{LIBRARY} has no symbol {symbol}; another NIXL version?")]
    Symbol {
        /// The missing symbol.
        symbol: &'static str,
        /// What the loader said.
        #[source]
        source: Arc<libloading::Error>,
    },
}

static LIBRARY_HANDLE: OnceLock<Result<libloading::Library, ProbeError>> = OnceLock::new();

/// Opens NIXL's C API once per process, from `path` or else by its name through the library
/// search path; later calls return the first answer, whatever their `path`. A library opened
/// from a path is the one the bindings use: the loader matches their `dlopen` by its soname.
pub fn library(path: Option<&Path>) -> Result<(), ProbeError> {
    LIBRARY_HANDLE
        .get_or_init(|| open(path))
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
}

fn open(path: Option<&Path>) -> Result<libloading::Library, ProbeError> {
    let name = path.map_or_else(|| LIBRARY.into(), |p| p.as_os_str().to_owned());
    // SAFETY: loading a shared library runs its initialisers. NIXL's are those the `stub-api`
    // bindings would run anyway when they open the same library on their first call.
    let library =
        unsafe { libloading::Library::new(&name) }.map_err(|e| ProbeError::Library(Arc::new(e)))?;
    for &symbol in SYMBOLS {
        // SAFETY: the symbol is only looked up, never called through this pointer, so the type
        // given (a pointer-sized function pointer) is not relied upon.
        let found = unsafe { library.get::<unsafe extern "C" fn()>(symbol.as_bytes()) };
        if let Err(e) = found {
            return Err(ProbeError::Symbol {
                symbol,
                source: Arc::new(e),
            });
        }
    }
    Ok(library)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_or_one_that_is_not_nixl_is_refused_with_the_reason() {
        let missing = open(Some(Path::new("/nonexistent/libnixl_capi.so")));
        match missing {
            Err(e @ ProbeError::Library(_)) => {
                // The loader's message, naming the path, is in the error's sources.
                let rendered = cli_support::render(&e);
                assert!(
                    rendered.contains("/nonexistent/libnixl_capi.so"),
                    "{rendered}"
                );
            }
            other => panic!("expected a library error, got {other:?}"),
        }
        // A real shared library without NIXL's symbols.
        match open(Some(Path::new("libc.so.6"))) {
            Err(ProbeError::Symbol { symbol, .. }) => assert!(SYMBOLS.contains(&symbol)),
            other => panic!("expected a symbol error, got {other:?}"),
        }
    }
}
