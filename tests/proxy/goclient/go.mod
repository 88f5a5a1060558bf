module gatekeeper.test/goclient

go 1.22
